"""The Qwen2 / Qwen3 / Llama decoder graph, built from a checkpoint (shared by the importers).

The graph is the contract of ``docs/qwen_graph.md``: standard ONNX (opset 23) plus the seed 000
extensions -- INT4 weights as ``EncodedValueProto`` in ``graph.encoded_initializer`` decoded by
``olv.Decode`` nodes, and ``graph.persistent_bindings`` retaining the KV cache between calls.
It is authored with :class:`olv_runtime.builder.GraphBuilder` (``docs/builder.md``): every node's
output types are inferred as it is added and the bindings are validated against the final graph.
:func:`build_model` reads a Hugging Face checkpoint (:mod:`olv_runtime.models.hf`) or a GGUF file
(:mod:`olv_runtime.models.gguf`, through a checkpoint-like view of its tensors).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from olv_runtime.builder import GraphBuilder
from olv_runtime.errors import ConversionError
from olv_runtime.models.checkpoint import Checkpoint
from olv_runtime.models.paged_kv import to_paged
from olv_runtime.proto import ModelProto, TensorProto
from olv_runtime.proto.helper import make_affine_encoded
from olv_runtime.structs.quantize import quantize_int4_blockwise

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "WEIGHT_FORMATS",
    "QwenConfig",
    "compute_inv_freq",
    "build_model",
]

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
WEIGHT_FORMATS = ("int4-block32", "float32")
#: INT4 block-scale types: float16 (default; 4.5 bits per weight, the bytes of GGUF Q4_0; the
#: encoded value is DequantizeLinear with a FLOAT16 scale and FLOAT output, exact in float32) or
#: float32 (5 bits per weight).
SCALE_DTYPES = ("float16", "float32")
OPSET = 23
OLV_DOMAIN = "olv"
OLV_OPSET = 1
IR_VERSION = 10
BLOCK_SIZE = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class QwenConfig:
    """The hyper-parameters the converter reads from ``config.json``.

    Parameters
    ----------
    config : dict
        Parsed ``config.json``.
    tensor_names : collection of str, optional
        Checkpoint tensor names, used to infer ``tie_word_embeddings`` when the config omits it
        (tied iff there is no ``lm_head.weight``).

    Raises
    ------
    ConversionError
        Unsupported architecture, missing key, unsupported RoPE type, activation or sliding
        window, inconsistent head counts.
    """

    def __init__(self, config: dict, tensor_names=()):
        archs = config.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            got = ", ".join(archs) if archs else f"none (model_type={config.get('model_type')!r})"
            raise ConversionError(
                f"unsupported architecture {got}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.architecture = arch

        def req(key):
            if config.get(key) is None:
                raise ConversionError(f"config.json ({arch}) has no {key!r}")
            return config[key]

        self.hidden_size = int(req("hidden_size"))
        self.num_layers = int(req("num_hidden_layers"))
        self.num_heads = int(req("num_attention_heads"))
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.intermediate_size = int(req("intermediate_size"))
        self.vocab_size = int(req("vocab_size"))
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.num_heads)
        self.rms_norm_eps = float(config.get("rms_norm_eps", 1e-6))
        if self.num_heads % self.num_kv_heads:
            raise ConversionError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConversionError(f"head_dim={self.head_dim} must be even for RoPE")

        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"hidden_act={act!r} is not supported (only 'silu')")

        if config.get("use_sliding_window"):
            layer_types = config.get("layer_types") or []
            if not layer_types or any(t != "full_attention" for t in layer_types):
                raise ConversionError("sliding-window attention (use_sliding_window) is not supported")

        rope = config.get("rope_parameters")
        if rope is not None and not isinstance(rope, dict):
            raise ConversionError(f"rope_parameters must be an object, got {type(rope).__name__}")
        rope = rope or {}
        legacy = config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or rope.get("type") or legacy.get("rope_type") \
            or legacy.get("type") or "default"
        if rope_type != "default":
            raise ConversionError(
                f"rope_type={rope_type!r} is not supported (only 'default' RoPE)"
            )
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is None:
            if arch == "LlamaForCausalLM":
                theta = 10000.0
            else:
                raise ConversionError(f"config.json ({arch}) has no rope_theta")
        self.rope_theta = float(theta)
        if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConversionError("partial_rotary_factor != 1 is not supported")

        tie = config.get("tie_word_embeddings")
        if tie is None:
            tie = "lm_head.weight" not in set(tensor_names)
        self.tie_word_embeddings = bool(tie)
        self.has_qk_norm = arch == "Qwen3ForCausalLM"
        # biases, as transformers builds the modules: Qwen2 always has q/k/v biases (and no
        # o_proj bias); Llama and Qwen3 follow config.attention_bias (q/k/v/o) and Llama
        # config.mlp_bias (gate/up/down)
        attn_bias = bool(config.get("attention_bias", False))
        self.qkv_bias = arch == "Qwen2ForCausalLM" or attn_bias
        self.o_bias = arch != "Qwen2ForCausalLM" and attn_bias
        self.mlp_bias = arch == "LlamaForCausalLM" and bool(config.get("mlp_bias", False))
        # not a Hugging Face key: set by the GGUF importer for llama files, whose q/k rows are
        # stored permuted for pairwise RoPE (models/gguf.py)
        self.rope_interleaved = bool(config.get("rope_interleaved", False))


def compute_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """RoPE inverse frequencies, as transformers' default RoPE computes them.

    transformers evaluates ``1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64)
    .float() / dim))`` in float32; the exponent is computed here identically (int64 arange →
    float32 → divide by ``dim`` in float32). torch's float32 ``pow`` (SLEEF, ≤ 1 ulp) is not
    reproducible bit for bit in numpy; the power is evaluated in float64 and rounded to float32
    (the correctly rounded value), which equals torch's except for rare near-halfway cases
    (then 1 ulp apart). The reciprocal is a float32 division as in transformers.

    Parameters
    ----------
    theta : float
        ``rope_theta``.
    head_dim : int
        Rotary dimension ``D`` (even).

    Returns
    -------
    numpy.ndarray
        float32 ``[D // 2]``.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    power = (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / power).astype(np.float32)


class _QwenBuilder:
    """The converter's helpers over :class:`~olv_runtime.builder.GraphBuilder`: checkpoint
    tensors become dense or encoded initializers under their checkpoint names (each stored once),
    and nodes are added with the names of ``docs/qwen_graph.md``. Every node's output types are
    inferred as it is added, so a wrong wiring fails here, naming the node."""

    def __init__(self, graph: GraphBuilder, weights: str, ckpt: Checkpoint,
                 scale_dtype: str = "float16"):
        self.b = graph
        self.weights = weights
        self.ckpt = ckpt
        self.scale_dtype = np.dtype(scale_dtype)
        # sources that store tensors in place (models/gguf.py GGUFCheckpoint) give the message
        # holding each tensor; the builder references it instead of reading the values
        self.stored = getattr(ckpt, "stored", None)
        self.used: set[str] = set()  # checkpoint tensors the graph uses (the rest is listed)

    def _require(self, ckpt_name: str, why: str) -> None:
        if ckpt_name not in self.ckpt:
            raise ConversionError(
                f"checkpoint {getattr(self.ckpt, 'path', '')!r} has no tensor {ckpt_name!r}, "
                f"which {why} needs"
            )

    def node(self, op_type, inputs, outputs, name, domain="", **attrs):
        return self.b.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs)

    def initializer(self, name: str, array: np.ndarray) -> str:
        if name not in self.b.initializer_names:
            self.b.make_initializer(name, array)
        return name

    def const_i64(self, key: str, values) -> str:
        """A shared int64 1-D constant initializer named ``const.<key>``."""
        name = f"const.{key}"
        return self.initializer(name, np.asarray(values, dtype=np.int64))

    def _checked(self, ckpt_name: str, expect_shape: tuple[int, ...]) -> np.ndarray:
        self.used.add(ckpt_name)
        arr = self.ckpt.get(ckpt_name)
        if tuple(arr.shape) != tuple(expect_shape):
            raise ConversionError(
                f"tensor {ckpt_name!r} has shape {list(arr.shape)}, expected {list(expect_shape)}"
            )
        return arr

    def in_place(self, ckpt_name: str, expect_shape: tuple[int, ...], prefix: str) -> str:
        """A tensor stored in place by the source (dense external initializer, or encoded value
        + ``olv.Decode`` node named ``<prefix>/Decode``); returns the float tensor's name."""
        kind = self.b.initializer_names.get(ckpt_name)
        self.used.add(ckpt_name)
        if kind is None:
            shape = tuple(self.ckpt.shape(ckpt_name))
            if shape != tuple(expect_shape):
                raise ConversionError(
                    f"tensor {ckpt_name!r} has shape {list(shape)}, expected {list(expect_shape)}"
                )
            msg = self.stored(ckpt_name)
            if isinstance(msg, TensorProto):
                self.b.make_initializer(ckpt_name, msg)
                kind = "dense"
            else:
                self.b.make_encoded_initializer(msg)
                kind = "encoded"
        if kind == "dense":
            return ckpt_name
        return self.node("Decode", [ckpt_name], [f"{prefix}/decoded"], f"{prefix}/Decode",
                         domain=OLV_DOMAIN)

    def dense(self, ckpt_name: str, expect_shape: tuple[int, ...]) -> str:
        """A dense float32 initializer from the checkpoint under its checkpoint name."""
        if self.stored is not None:
            return self.in_place(ckpt_name, expect_shape, ckpt_name)
        if ckpt_name in self.b.initializer_names:
            return ckpt_name
        arr = self._checked(ckpt_name, expect_shape)
        return self.initializer(ckpt_name, np.ascontiguousarray(arr, dtype=np.float32))

    def weight(self, ckpt_name: str, expect_shape: tuple[int, int]) -> str:
        """Store a [N, K] matrix per the weight format; returns the stored value's name."""
        if self.weights == "float32":
            return self.dense(ckpt_name, expect_shape)
        if ckpt_name in self.b.initializer_names:
            return ckpt_name
        arr = self._checked(ckpt_name, expect_shape)
        try:
            payload, scale = quantize_int4_blockwise(arr, BLOCK_SIZE, self.scale_dtype)
        except ValueError as exc:
            raise ConversionError(f"tensor {ckpt_name!r}: {exc}") from None
        return self.b.make_encoded_initializer(make_affine_encoded(
            ckpt_name, payload.tobytes(), TensorProto.INT4, list(arr.shape), scale,
            None, axis=1, block_size=BLOCK_SIZE,
        ))

    def matrix(self, ckpt_name: str, prefix: str, expect_shape: tuple[int, int]) -> str:
        """The float [N, K] matrix value: ``olv.Decode`` output (int4) or the initializer."""
        if self.stored is not None:
            return self.in_place(ckpt_name, expect_shape, prefix)
        stored = self.weight(ckpt_name, expect_shape)
        if self.weights == "float32":
            return stored
        return self.node("Decode", [stored], [f"{prefix}/decoded"], f"{prefix}/Decode",
                         domain=OLV_DOMAIN)

    def linear(self, x: str, ckpt_prefix: str, prefix: str, n: int, k: int,
               bias: str | None = None) -> str:
        """``MatMul(x, Transpose(W))``, + ``<ckpt_prefix>.bias`` when the architecture has one
        (``bias`` names why, e.g. ``"Qwen2ForCausalLM q_proj"``; the tensor is then required,
        as transformers requires it: a missing bias is a ConversionError, never a silent 0)."""
        self._require(f"{ckpt_prefix}.weight", "the graph")
        w = self.matrix(f"{ckpt_prefix}.weight", prefix, (n, k))
        wt = self.node("Transpose", [w], [f"{prefix}/weight_t"], f"{prefix}/Transpose", perm=[1, 0])
        y = self.node("MatMul", [x, wt], [f"{prefix}/matmul"], f"{prefix}/MatMul")
        if bias is not None:
            self._require(f"{ckpt_prefix}.bias", bias)
            b = self.dense(f"{ckpt_prefix}.bias", (n,))
            y = self.node("Add", [y, b], [f"{prefix}/output"], f"{prefix}/Add")
        return y

    def rms_norm(self, x: str, weight: str, size: int, prefix: str, eps: float) -> str:
        w = self.dense(weight, (size,))
        return self.node("RMSNormalization", [x, w], [f"{prefix}/output"],
                         f"{prefix}/RMSNormalization", axis=-1, epsilon=eps)


def _position_subgraph(b: _QwenBuilder, cfg: QwenConfig) -> tuple[str, str]:
    """cos/sin ``[B, S, D/2]`` from ``Range(past_len, past_len + S)`` and ``inv_freq``."""
    p = "rotary"
    inv_freq = b.initializer("model.rotary_emb.inv_freq",
                             compute_inv_freq(cfg.rope_theta, cfg.head_dim))
    axes0 = b.const_i64("axes_0", [0])
    axes1 = b.const_i64("axes_1", [1])
    past_len_1d = b.node("Shape", ["past_key.0"], [f"{p}/past_len_1d"], f"{p}/Shape_past_len",
                         start=2, end=3)
    past_len = b.node("Squeeze", [past_len_1d, axes0], [f"{p}/past_len"], f"{p}/Squeeze_past_len")
    seq_len_1d = b.node("Shape", ["input_ids"], [f"{p}/seq_len_1d"], f"{p}/Shape_seq_len",
                        start=1, end=2)
    seq_len = b.node("Squeeze", [seq_len_1d, axes0], [f"{p}/seq_len"], f"{p}/Squeeze_seq_len")
    total = b.node("Add", [past_len, seq_len], [f"{p}/total_len"], f"{p}/Add_total_len")
    one = b.initializer("const.one_i64", np.asarray(1, dtype=np.int64))
    positions = b.node("Range", [past_len, total, one], [f"{p}/positions"], f"{p}/Range")
    pos_f = b.node("Cast", [positions], [f"{p}/positions_f"], f"{p}/Cast_positions",
                   to=TensorProto.FLOAT)
    pos_col = b.node("Unsqueeze", [pos_f, axes1], [f"{p}/positions_col"], f"{p}/Unsqueeze_positions")
    inv_row = b.node("Unsqueeze", [inv_freq, axes0], [f"{p}/inv_freq_row"], f"{p}/Unsqueeze_inv_freq")
    freqs = b.node("Mul", [pos_col, inv_row], [f"{p}/freqs"], f"{p}/Mul_freqs")  # [S, D/2]
    cos_sd = b.node("Cos", [freqs], [f"{p}/cos_sd"], f"{p}/Cos")
    sin_sd = b.node("Sin", [freqs], [f"{p}/sin_sd"], f"{p}/Sin")
    cos_1sd = b.node("Unsqueeze", [cos_sd, axes0], [f"{p}/cos_1sd"], f"{p}/Unsqueeze_cos")
    sin_1sd = b.node("Unsqueeze", [sin_sd, axes0], [f"{p}/sin_1sd"], f"{p}/Unsqueeze_sin")
    batch_1d = b.node("Shape", ["input_ids"], [f"{p}/batch_1d"], f"{p}/Shape_batch", start=0, end=1)
    ones2 = b.const_i64("ones_2", [1, 1])
    expand_shape = b.node("Concat", [batch_1d, ones2], [f"{p}/expand_shape"], f"{p}/Concat_expand_shape",
                          axis=0)
    cos = b.node("Expand", [cos_1sd, expand_shape], ["rotary/cos"], f"{p}/Expand_cos")
    sin = b.node("Expand", [sin_1sd, expand_shape], ["rotary/sin"], f"{p}/Expand_sin")
    return cos, sin


def _qk_norm(b: _QwenBuilder, x: str, weight: str, heads: int, cfg: QwenConfig, prefix: str) -> str:
    d = cfg.head_dim
    split = b.const_i64(f"shape_heads_{heads}x{d}", [0, 0, heads, d])
    merge = b.const_i64(f"shape_flat_{heads * d}", [0, 0, heads * d])
    x4 = b.node("Reshape", [x, split], [f"{prefix}/heads"], f"{prefix}/Reshape_split")
    n4 = b.rms_norm(x4, weight, d, prefix, cfg.rms_norm_eps)
    return b.node("Reshape", [n4, merge], [f"{prefix}/flat"], f"{prefix}/Reshape_merge")


def _decoder_layer(b: _QwenBuilder, cfg: QwenConfig, h: str, i: int, cos: str, sin: str) -> str:
    """Layer ``i``: pre-norm attention (q/k/v projections, optional q/k norms, RoPE, Attention
    with the layer's past/present KV) and pre-norm SwiGLU MLP, each added to the residual ``h``;
    returns the new residual's name."""
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    c = f"model.layers.{i}"   # checkpoint prefix
    p = f"layers.{i}"         # graph name prefix
    x = b.rms_norm(h, f"{c}.input_layernorm.weight", hidden, f"{p}/input_layernorm", cfg.rms_norm_eps)
    qkv_b = f"{cfg.architecture} attention (q/k/v biases)" if cfg.qkv_bias else None
    o_b = f"{cfg.architecture} attention_bias (o_proj bias)" if cfg.o_bias else None
    mlp_b = f"{cfg.architecture} mlp_bias" if cfg.mlp_bias else None
    q = b.linear(x, f"{c}.self_attn.q_proj", f"{p}/self_attn/q_proj", H * D, hidden, qkv_b)
    k = b.linear(x, f"{c}.self_attn.k_proj", f"{p}/self_attn/k_proj", KVH * D, hidden, qkv_b)
    v = b.linear(x, f"{c}.self_attn.v_proj", f"{p}/self_attn/v_proj", KVH * D, hidden, qkv_b)
    if cfg.has_qk_norm:
        q = _qk_norm(b, q, f"{c}.self_attn.q_norm.weight", H, cfg, f"{p}/self_attn/q_norm")
        k = _qk_norm(b, k, f"{c}.self_attn.k_norm.weight", KVH, cfg, f"{p}/self_attn/k_norm")
    q = b.node("RotaryEmbedding", [q, cos, sin], [f"{p}/self_attn/q_rotary"],
               f"{p}/self_attn/RotaryEmbedding_q", num_heads=H,
               interleaved=int(cfg.rope_interleaved))
    k = b.node("RotaryEmbedding", [k, cos, sin], [f"{p}/self_attn/k_rotary"],
               f"{p}/self_attn/RotaryEmbedding_k", num_heads=KVH,
               interleaved=int(cfg.rope_interleaved))
    a, _, _ = b.node(
        "Attention",
        [q, k, v, "", f"past_key.{i}", f"past_value.{i}"],
        [f"{p}/self_attn/attention", f"present_key.{i}", f"present_value.{i}"],
        f"{p}/self_attn/Attention",
        is_causal=1, q_num_heads=H, kv_num_heads=KVH, scale=1.0 / math.sqrt(D),
    )
    o = b.linear(a, f"{c}.self_attn.o_proj", f"{p}/self_attn/o_proj", hidden, H * D, o_b)
    h = b.node("Add", [h, o], [f"{p}/attn_residual"], f"{p}/Add_attn_residual")
    x = b.rms_norm(h, f"{c}.post_attention_layernorm.weight", hidden,
                   f"{p}/post_attention_layernorm", cfg.rms_norm_eps)
    gt = b.linear(x, f"{c}.mlp.gate_proj", f"{p}/mlp/gate_proj", inter, hidden, mlp_b)
    up = b.linear(x, f"{c}.mlp.up_proj", f"{p}/mlp/up_proj", inter, hidden, mlp_b)
    sg = b.node("Sigmoid", [gt], [f"{p}/mlp/gate_sigmoid"], f"{p}/mlp/Sigmoid")
    act = b.node("Mul", [gt, sg], [f"{p}/mlp/gate_silu"], f"{p}/mlp/Mul_silu")
    gu = b.node("Mul", [act, up], [f"{p}/mlp/gate_up"], f"{p}/mlp/Mul_up")
    dn = b.linear(gu, f"{c}.mlp.down_proj", f"{p}/mlp/down_proj", hidden, inter, mlp_b)
    h = b.node("Add", [h, dn], [f"{p}/mlp_residual"], f"{p}/Add_mlp_residual")
    return h


def _metadata(cfg: QwenConfig, ckpt, weights: str, in_place: bool) -> dict:
    """The model's ``olv.*`` metadata_props (architecture, sizes, weights format, RoPE, eos, the
    GGUF source's own keys for an in-place import)."""
    L, H, KVH, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    meta = {
        "olv.architecture": cfg.architecture,
        "olv.num_layers": L,
        "olv.num_heads": H,
        "olv.num_kv_heads": KVH,
        "olv.head_dim": D,
        "olv.hidden_size": hidden,
        "olv.vocab_size": vocab,
        "olv.weights": weights,
        "olv.intermediate_size": inter,
        "olv.rope_theta": repr(cfg.rope_theta),
        "olv.rms_norm_eps": repr(cfg.rms_norm_eps),
        "olv.tie_word_embeddings": int(cfg.tie_word_embeddings),
    }
    maxpos = ckpt.config.get("max_position_embeddings")
    if isinstance(maxpos, int) and not isinstance(maxpos, bool) and maxpos > 0:
        meta["olv.max_position_embeddings"] = maxpos  # generate/CLI warn beyond it
    eos = ckpt.config.get("eos_token_id")
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if isinstance(eos, int):
        meta["olv.eos_token_id"] = eos
    if cfg.rope_interleaved:
        meta["olv.rope_interleaved"] = 1
    if in_place:
        meta.update(ckpt.metadata_props())
    return meta


def build_model(checkpoint: Checkpoint | str | os.PathLike, weights: str = "int4-block32",
                *, progress: Callable[[str], None] | None = None,
                kv: str = "contiguous", scale_dtype: str = "float16",
                unused: list | None = None) -> ModelProto:
    """Build the ``docs/qwen_graph.md`` model of a checkpoint.

    Parameters
    ----------
    checkpoint : Checkpoint or path
        An open :class:`~olv_runtime.models.checkpoint.Checkpoint` or its directory.
    weights : {"int4-block32", "float32"}
        Linear/embedding weight format: encoded symmetric INT4 blocks of 32, or dense float32.
    progress : callable, optional
        Called with a short message before each layer (and the embedding / head).
    kv : {"contiguous", "paged", "paged-int8", "paged-f16", "paged-int4", "paged-mixed"}
        KV cache kind: past/present tensors (default) or per-layer paged cache structs
        (:func:`olv_runtime.models.paged_kv.to_paged`, ``docs/kv_cache.md``).
    scale_dtype : {"float16", "float32"}
        Type of the INT4 block-32 scales (default float16: 4.5 bits per weight, equal bytes
        with GGUF Q4_0; decoded values are ``float32(q) * float32(scale)``, exact). A scale that
        overflows float16 raises ConversionError (use float32).
    unused : list, optional
        Receives the names of checkpoint tensors the graph does not use (also reported through
        ``progress``), e.g. a ``lm_head.weight`` of a tied model or biases the architecture
        does not have.

    Returns
    -------
    ModelProto
        olv_runtime's ModelProto (opsets ``""`` 23 and ``"olv"`` 1, ir_version 10).

    Raises
    ------
    ConversionError
        Unsupported architecture or config, unknown ``weights``, missing or misshapen tensor.
    """
    in_place = hasattr(checkpoint, "stored")  # models/gguf.py: tensors referenced in place
    if in_place:
        weights = "gguf"
    elif weights not in WEIGHT_FORMATS:
        raise ConversionError(f"unknown weights format {weights!r}; supported: {', '.join(WEIGHT_FORMATS)}")
    ckpt = checkpoint if (in_place or isinstance(checkpoint, Checkpoint)) else Checkpoint(checkpoint)
    cfg = QwenConfig(ckpt.config, ckpt.keys())
    report = progress or (lambda msg: None)

    gb = GraphBuilder(cfg.architecture, opsets={"": OPSET, OLV_DOMAIN: OLV_OPSET},
                      ir_version=IR_VERSION)
    if in_place:
        gb.add_struct_types(ckpt.struct_types())
    b = _QwenBuilder(gb, weights, ckpt, scale_dtype)

    L, KVH, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    hidden, vocab = cfg.hidden_size, cfg.vocab_size

    # Inputs (outputs and bindings are declared once their producers exist, at the end).
    gb.add_input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    for i in range(L):
        for kind in ("key", "value"):
            gb.add_input(f"past_{kind}.{i}", TensorProto.FLOAT, ["batch", KVH, "past_sequence", D])

    # Embedding.
    report(f"embedding model.embed_tokens.weight [{vocab}, {hidden}] ({weights})")
    emb = b.matrix("model.embed_tokens.weight", "model/embed_tokens", (vocab, hidden))
    h = b.node("Gather", [emb, "input_ids"], ["model/embed_tokens/output"],
               "model/embed_tokens/Gather", axis=0)

    cos, sin = _position_subgraph(b, cfg)

    for i in range(L):
        report(f"layer {i + 1}/{L}")
        h = _decoder_layer(b, cfg, h, i, cos, sin)

    report("final norm and lm_head" + (" (tied to embed_tokens)" if cfg.tie_word_embeddings else ""))
    x = b.rms_norm(h, "model.norm.weight", hidden, "model/norm", cfg.rms_norm_eps)
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    w = b.matrix(f"{head}.weight", "lm_head", (vocab, hidden))
    wt = b.node("Transpose", [w], ["lm_head/weight_t"], "lm_head/Transpose", perm=[1, 0])
    if not cfg.tie_word_embeddings and "lm_head.bias" in ckpt:
        y = b.node("MatMul", [x, wt], ["lm_head/matmul"], "lm_head/MatMul")
        b.node("Add", [y, b.dense("lm_head.bias", (vocab,))], ["logits"], "lm_head/Add")
    else:
        b.node("MatMul", [x, wt], ["logits"], "lm_head/MatMul")

    gb.add_output("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])
    for i in range(L):
        for kind in ("key", "value"):
            gb.add_output(f"present_{kind}.{i}", TensorProto.FLOAT,
                          ["batch", KVH, "total_sequence", D])
    for i in range(L):
        for kind in ("key", "value"):
            gb.add_binding(f"past_{kind}.{i}", f"present_{kind}.{i}")
    model = gb.to_model(release=True)  # validates the bindings; hands over the payloads
    left = sorted(set(ckpt.keys()) - b.used)
    if left:
        report(f"{len(left)} checkpoint tensors not used by the {cfg.architecture} graph: "
               + ", ".join(left[:20]) + (" ..." if len(left) > 20 else ""))
    if unused is not None:
        unused.extend(left)
    model.producer_name = "olv_runtime"
    model.producer_version = "0.1.0"

    meta = _metadata(cfg, ckpt, weights, in_place)
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key = key
        entry.value = str(value)
    if kv != "contiguous":  # the paged graph is a rewrite of the contiguous one
        to_paged(model, kv)
    return model
