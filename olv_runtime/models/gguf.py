"""Import GGUF files (llama.cpp's format) as olv_runtime models, zero-copy.

``olv convert model.gguf out.onnx`` (:func:`convert_gguf`) builds the graph of
``docs/qwen_graph.md`` with the same builder as the Hugging Face converter
(:func:`olv_runtime.models.qwen_graph.build_model`), reading a :class:`GGUFCheckpoint` instead of a
safetensors directory:

* the GGUF metadata (``general.architecture`` ``qwen2`` / ``qwen3`` / ``llama``, block count,
  embedding / feed-forward lengths, head counts, key length, RoPE base, RMS epsilon, vocabulary
  size, ``output.weight`` absent = tied embeddings) becomes the converter's config;
* GGUF tensor names (``blk.N.attn_q.weight``, ...) map to the Hugging Face names of the graph
  (:data:`TENSOR_NAMES`);
* every tensor stays inside the .gguf: F32 tensors become dense ``TensorProto`` initializers and
  every other type an ``EncodedValueProto`` whose ``struct_type`` is a ``type_ref`` to its ggml row
  declaration (:mod:`olv_runtime.structs.ggml`), both with ``data_location = EXTERNAL`` and
  ``external_data`` = the .gguf's file name relative to the model, the tensor's absolute offset
  and byte length. No weight byte is copied or rewritten; the .onnx holds the graph, the struct
  catalogue and the metadata;
* ``llama`` files store attn_q / attn_k rows permuted for ggml's pairwise RoPE (llama.cpp's
  ``convert_hf_to_gguf.py``); rather than un-permuting (a copy), the graph rotates adjacent pairs
  (``RotaryEmbedding(interleaved=1)``), which gives the same attention scores;
* the ``tokenizer.ggml.*`` metadata becomes ``tokenizer.json`` (+ ``tokenizer_config.json``)
  beside the model (:mod:`olv_runtime.models.gguf_tokenizer`).

The GGUF header is parsed by the bounded reader :mod:`olv_runtime.models.gguf_reader`.
"""
from __future__ import annotations

import os
import pathlib
import re
import warnings
from collections.abc import Callable

from olv_runtime.errors import ConversionError
from olv_runtime.io import save
from olv_runtime.io.sidecars import check_replacements, record
from olv_runtime.models.gguf_reader import GGUFFile, GGUFTensorInfo
from olv_runtime.models.gguf_tokenizer import tokenizer_files
from olv_runtime.models.qwen_graph import build_model
from olv_runtime.proto import ModelProto, TensorProto
from olv_runtime.structs import ggml

__all__ = ["ARCHITECTURES", "TENSOR_NAMES", "GGUFCheckpoint", "build_gguf_model", "convert_gguf"]

#: GGUF ``general.architecture`` -> the converter's Hugging Face architecture.
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "llama": "LlamaForCausalLM"}

#: GGUF tensor name -> Hugging Face tensor name (``{i}``: the layer).
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h)
             for g, h in TENSOR_NAMES.items()]


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name (None if it has none)."""
    for pat, h in _PATTERNS:
        m = pat.match(gguf_name)
        if m:
            return h.format(i=int(m.group(1))) if m.groups() else h
    return None


class GGUFCheckpoint:
    """A GGUF file seen as the converter's checkpoint: HF-style config and tensor names, and
    for each tensor the zero-copy message that stores it (:meth:`stored`).

    Parameters
    ----------
    path : str or os.PathLike
        The .gguf file (parsed and validated by :class:`~olv_runtime.models.gguf_reader.GGUFFile`).
    location : str, optional
        The file's location relative to the model that will reference it (default: its name).

    Attributes
    ----------
    gguf : GGUFFile
    config : dict
        ``config.json``-style keys for :class:`~olv_runtime.models.qwen_graph.QwenConfig`, plus
        ``rope_interleaved`` (True for ``llama``).

    Raises
    ------
    GGUFFormatError
        Malformed or hostile file.
    ConversionError
        Unsupported architecture, missing or inconsistent metadata, an unmapped tensor, an
        unsupported tensor type, RoPE scaling or partial rotary dimensions.
    """

    def __init__(self, path, location: str | None = None):
        self.path = os.fspath(path)
        self.gguf = GGUFFile(self.path)
        try:
            self.location = location or os.path.basename(self.path)
            self._names: dict[str, GGUFTensorInfo] = {}
            for name, info in self.gguf.tensors.items():
                h = hf_name(name)
                if h is None:
                    raise ConversionError(
                        f"{self.path}: tensor {name!r} has no place in the "
                        f"{self.gguf.get('general.architecture')} graph (rope_freqs means "
                        "RoPE scaling, which is not supported)" if name.startswith("rope_freqs")
                        else f"{self.path}: tensor {name!r} has no place in the "
                        f"{self.gguf.get('general.architecture')} graph")
                if info.type_name != "F32":
                    ggml.ggml_type_of(info.type_name)  # ConversionError if unsupported
                self._names[h] = info
            self.config = self._config()
        except BaseException:
            self.gguf.close()
            raise

    # -- config ----------------------------------------------------------------------------------
    def _config(self) -> dict:
        g = self.gguf
        arch = g.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ConversionError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; supported: "
                + ", ".join(ARCHITECTURES)
            )

        def req(key):
            full = f"{arch}.{key}"
            v = g.get(full)
            if v is None:
                raise ConversionError(f"{self.path}: GGUF metadata has no {full!r}")
            return v

        def opt(key, default=None):
            return g.get(f"{arch}.{key}", default)

        def integer(key, v, lo, hi):
            """Metadata integer ``key`` in [lo, hi] (ConversionError naming it otherwise)."""
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConversionError(f"{self.path}: GGUF {key} must be an integer in [{lo}, "
                                      f"{hi}], got {type(v).__name__} {str(v)[:40]}")
            return v

        def number(key, v):
            """Metadata float ``key``: finite and > 0."""
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ConversionError(f"{self.path}: GGUF {key} must be a finite number > 0, "
                                      f"got {type(v).__name__} {str(v)[:40]}")
            return float(v)

        hidden = integer(f"{arch}.embedding_length", req("embedding_length"), 1, 1 << 20)
        heads = integer(f"{arch}.attention.head_count", req("attention.head_count"), 1, hidden)
        kv_heads = opt("attention.head_count_kv", heads)
        if not isinstance(kv_heads, int):  # per-layer arrays (hybrid models) are not supported
            raise ConversionError(f"{self.path}: {arch}.attention.head_count_kv must be one "
                                  f"integer, got {type(kv_heads).__name__}")
        kv_heads = integer(f"{arch}.attention.head_count_kv", kv_heads, 1, heads)
        if heads % kv_heads:
            raise ConversionError(f"{self.path}: {arch}.attention.head_count {heads} is not a "
                                  f"multiple of head_count_kv {kv_heads}")
        head_dim = integer(f"{arch}.attention.key_length",
                           opt("attention.key_length", hidden // heads), 1, 1 << 16)
        if opt("attention.value_length", head_dim) != head_dim:
            raise ConversionError(f"{self.path}: key_length != value_length is not supported")
        rot = opt("rope.dimension_count")
        if rot is not None and rot != head_dim:
            raise ConversionError(f"{self.path}: {arch}.rope.dimension_count={str(rot)[:40]} != "
                                  f"head_dim {head_dim} (partial rotary) is not supported")
        scaling = opt("rope.scaling.type")
        if scaling not in (None, "none"):
            raise ConversionError(f"{self.path}: {arch}.rope.scaling.type={str(scaling)[:40]!r} "
                                  "is not supported (only plain RoPE)")
        emb = self._names.get("model.embed_tokens.weight")
        if emb is None:
            raise ConversionError(f"{self.path}: no token_embd.weight tensor")
        # the layers the file has tensors for: block_count must name exactly those (a count of
        # 10**9 over 2 layers of tensors would otherwise build a graph layer by layer)
        have = {int(m.group(1)) for n in self._names
                if (m := re.match(r"model\.layers\.(\d+)\.", n))}
        blocks = integer(f"{arch}.block_count", req("block_count"), 1, 1 << 16)
        if have != set(range(blocks)):
            raise ConversionError(
                f"{self.path}: GGUF {arch}.block_count is {blocks}, but the file has tensors "
                f"for {len(have)} layers ({sorted(have)[:8]}{'...' if len(have) > 8 else ''})")
        vocab = opt("vocab_size")
        if vocab is None:
            tokens = g.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if isinstance(tokens, list) else emb.shape[0]
        vocab = integer(f"{arch}.vocab_size", vocab, 1, 1 << 24)
        cfg = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "hidden_size": hidden,
            "num_hidden_layers": blocks,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": integer(f"{arch}.feed_forward_length",
                                         req("feed_forward_length"), 1, 1 << 24),
            "vocab_size": vocab,
            "head_dim": head_dim,
            "rms_norm_eps": number(f"{arch}.attention.layer_norm_rms_epsilon",
                                   req("attention.layer_norm_rms_epsilon")),
            "rope_theta": number(f"{arch}.rope.freq_base", opt("rope.freq_base", 10000.0)),
            "max_position_embeddings": integer(f"{arch}.context_length",
                                               opt("context_length", 4096), 1, 1 << 31),
            "tie_word_embeddings": "lm_head.weight" not in self._names,
            "hidden_act": "silu",
            "rope_interleaved": arch == "llama",
        }
        eos = g.get("tokenizer.ggml.eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = integer("tokenizer.ggml.eos_token_id", eos, 0, vocab - 1)
        bos = g.get("tokenizer.ggml.bos_token_id")
        if bos is not None:
            cfg["bos_token_id"] = integer("tokenizer.ggml.bos_token_id", bos, 0, vocab - 1)
        return cfg

    # -- the checkpoint interface of models/qwen.py ------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def info(self, name: str) -> GGUFTensorInfo:
        try:
            return self._names[name]
        except KeyError:
            raise ConversionError(f"{self.path}: no tensor for {name!r} (GGUF names: "
                                  f"{sorted(self.gguf.tensors)[:8]}...)") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def get(self, name: str):
        """Not available: a GGUF import never materialises a float weight."""
        raise ConversionError(
            f"{self.path}: {name!r} is read through stored() (GGUF tensors are referenced in "
            "place, never converted)"
        )

    def struct_types(self) -> list:
        """The ggml block and row declarations every non-F32 tensor references."""
        used = sorted({(i.type_name, i.shape[-1], len(i.shape) == 1)
                       for i in self._names.values() if i.type_name != "F32"})
        return ggml.declarations(used)

    def stored(self, name: str):
        """The message storing tensor ``name`` in place: an external dense ``TensorProto`` (F32)
        or an external ``EncodedValueProto`` with a ggml row type (every other type).

        Raises
        ------
        ConversionError
            Unknown name, or a tensor of rank above 2.
        """
        info = self.info(name)
        if info.type_name == "F32":
            t = TensorProto(name=name, data_type=TensorProto.FLOAT)
            t.dims.extend(info.shape)
            t.data_location = TensorProto.EXTERNAL
            t.external_data.add(key="location", value=self.location)
            t.external_data.add(key="offset", value=str(info.offset))
            t.external_data.add(key="length", value=str(info.nbytes))
            return t
        return ggml.make_ggml_encoded(name, info.type_name, info.shape, location=self.location,
                                      offset=info.offset, length=info.nbytes)

    def metadata_props(self) -> dict[str, str]:
        """Model metadata recording the source."""
        g = self.gguf
        types = sorted({i.type_name for i in self._names.values()})
        out = {"olv.source": "gguf", "olv.gguf.file": self.location,
               "olv.gguf.tensor_types": ",".join(types)}
        if g.get("general.file_type") is not None:
            out["olv.gguf.file_type"] = str(g.get("general.file_type"))
        if g.get("general.name") is not None:
            out["olv.gguf.name"] = str(g.get("general.name"))
        return out

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_gguf_model(path, *, location: str | None = None,
                     progress: Callable[[str], None] | None = None) -> ModelProto:
    """The ModelProto of a GGUF file (external data at ``location``, default its file name).

    Raises
    ------
    GGUFFormatError, ConversionError
        See :class:`GGUFCheckpoint` and :func:`olv_runtime.models.qwen_graph.build_model`.
    """
    with GGUFCheckpoint(path, location) as ckpt:
        return build_model(ckpt, "gguf", progress=progress)


def _location_for(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> str:
    """The .gguf's location relative to ``out_dir``; a hard link (no bytes copied) when the file
    lies outside it (external data must stay inside the model's directory)."""
    g = gguf_path.resolve()
    if out_dir in g.parents:
        return g.relative_to(out_dir).as_posix()
    link = out_dir / g.name
    if link.exists():
        if os.path.samefile(link, g):
            return g.name
        raise ConversionError(
            f"{link} exists and is not {g}; write the .onnx into the GGUF's directory "
            f"({g.parent}) or remove it"
        )
    try:
        os.link(g, link)
    except OSError as exc:
        raise ConversionError(
            f"the model's external data must lie inside its directory {out_dir}, and {g} "
            f"cannot be hard-linked there ({exc}); write the .onnx into {g.parent}"
        ) from None
    return g.name


def convert_gguf(gguf_path, out_path, *, progress: Callable[[str], None] | None = None,
                 tokenizer: bool = True, **_ignored) -> ModelProto:
    """Convert a GGUF file to an olv ONNX model whose payloads point into the .gguf.

    Parameters
    ----------
    gguf_path : str or os.PathLike
        ``qwen2`` / ``qwen3`` / ``llama`` GGUF file with tensor types F32, F16, BF16, Q8_0,
        Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
    out_path : str or os.PathLike
        Output .onnx. When the .gguf lies outside its directory, a hard link to it is made there
        (0 bytes copied); ConversionError if that is impossible (other file system).
    progress : callable, optional
    tokenizer : bool
        Also write ``tokenizer.json`` / ``tokenizer_config.json`` from ``tokenizer.ggml.*``
        beside the model (skipped when the file has no tokenizer metadata).

    Returns
    -------
    ModelProto
        The model written (every tensor external, in the .gguf).

    Raises
    ------
    GGUFFormatError, ConversionError
    """
    gguf_path = pathlib.Path(gguf_path)
    out = pathlib.Path(out_path)
    out_dir = out.parent.resolve()
    # parse and build before touching the output directory (a failure leaves it as it was)
    location = (gguf_path.resolve().relative_to(out_dir).as_posix()
                if out_dir in gguf_path.resolve().parents else gguf_path.name)
    with GGUFCheckpoint(gguf_path, location) as ckpt:
        model = build_model(ckpt, "gguf", progress=progress)
        files = {}
        if tokenizer:
            try:
                files = tokenizer_files(ckpt.gguf)
            except ConversionError as exc:  # the model converts; text prompts will not work
                warnings.warn(f"no tokenizer written: {exc}", stacklevel=2)
                if progress:
                    progress(f"no tokenizer written: {exc}")
    check_replacements(out, {fname: text.encode("utf-8") for fname, text in files.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    if _location_for(gguf_path, out_dir) != location:  # pragma: no cover - defensive
        raise ConversionError(f"location of {gguf_path} changed during conversion")
    if progress:
        progress(f"writing {out} (payloads stay in {location})")
    record(model, {fname: text.encode("utf-8") for fname, text in files.items()})
    save(model, out, external_data=False, keep_external=True)
    for fname, text in files.items():
        (out.parent / fname).write_text(text, encoding="utf-8")
    return model
