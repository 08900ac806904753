"""Small random Qwen2 checkpoints built locally with numpy (no download, no torch).

Used by ``olv demo`` and the benchmarks: writes ``config.json``, ``model.safetensors`` (float32)
and a ``tokenizer.json`` (a byte-level BPE trained in-process on a built-in text with the
``tokenizers`` library), the layout of a Hugging Face checkpoint directory.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

_TEXT = (
    "olv runtime runs quantized language models on the cpu. the weights are stored as int4 "
    "blocks with one scale per block, and the key value cache is carried between calls by "
    "persistent bindings declared in the graph. decoding one token reads every weight once, so "
    "the speed is bounded by memory bandwidth. prefill reads the weights once for many tokens. "
    "the quick brown fox jumps over the lazy dog. hello world, hello tokens, hello decode loop. "
)


def build_tokenizer(vocab_size: int = 384):
    """Train a byte-level BPE tokenizer (``tokenizers``) on a built-in text.

    Returns
    -------
    tokenizers.Tokenizer
        With ``<|endoftext|>`` as special token 0.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    return tok


def write_random_qwen2(
    out_dir,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 352,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    with_tokenizer: bool = True,
) -> pathlib.Path:
    """Write a random ``Qwen2ForCausalLM`` checkpoint directory.

    Parameters
    ----------
    out_dir : path-like
        Created if missing.
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size
        Model geometry (head_dim = hidden_size // num_attention_heads).
    vocab_size : int, optional
        Defaults to the tokenizer's vocabulary size (or 384 without tokenizer).
    tie_word_embeddings : bool
    seed : int
        numpy seed; weights ~ N(0, 0.02), norms 1, biases ~ N(0, 0.02).

    Returns
    -------
    pathlib.Path
        The directory.
    """
    from safetensors.numpy import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer() if with_tokenizer else None
    if vocab_size is None:
        vocab_size = tok.get_vocab_size() if tok is not None else 384
    if tok is not None:
        tok.save(str(out / "tokenizer.json"))
    head_dim = hidden_size // num_attention_heads
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    h, kv = hidden_size, num_key_value_heads * head_dim
    tensors = {"model.embed_tokens.weight": w(vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.q_proj.bias": w(h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.k_proj.bias": w(kv),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.v_proj.bias": w(kv),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(intermediate_size, h),
            p + "mlp.up_proj.weight": w(intermediate_size, h),
            p + "mlp.down_proj.weight": w(h, intermediate_size),
        })
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = w(vocab_size, h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


#: The ChatML template of Qwen2 instruct models (the subset without tools): what
#: :func:`write_chat_checkpoint` puts in tokenizer_config.json.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_chat_checkpoint(out_dir, *, seed: int = 0, **geometry) -> pathlib.Path:
    """Write a small random Qwen2 checkpoint with a real tokenizer and a chat template
    (``olv make-checkpoint``): :func:`write_random_qwen2`'s ``config.json`` and
    ``model.safetensors``, a byte-level BPE ``tokenizer.json`` with the special tokens
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, a ``tokenizer_config.json`` carrying the
    ChatML ``chat_template`` (:data:`CHATML_TEMPLATE`, eos ``<|im_end|>``) and a
    ``generation_config.json`` with both eos ids. No torch, no download.

    Parameters
    ----------
    out_dir : path-like
        Created if missing.
    seed : int
        Weights seed.
    **geometry
        hidden_size, num_hidden_layers, ... (:func:`write_random_qwen2`).

    Returns
    -------
    pathlib.Path
    """
    tok = build_tokenizer()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    out = write_random_qwen2(out_dir, seed=seed, with_tokenizer=False,
                             vocab_size=tok.get_vocab_size(), **geometry)
    tok.save(str(out / "tokenizer.json"))
    end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML_TEMPLATE},
        indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]},
                                                           indent=2))
    return out
