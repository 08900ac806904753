"""Build a random Qwen2.5-0.5B-shaped checkpoint locally (no download) with transformers.

    python bench/make_checkpoint.py OUT_DIR [--dtype bfloat16] [--layers 24] [--shape qwen2.5-0.5b]

Shapes (:data:`SHAPES`): ``qwen2.5-0.5b`` -- hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings, q/k/v biases (Qwen2ForCausalLM);
``qwen3-0.6b`` -- hidden 1024, 28 layers, 16 heads of 128, 8 KV heads, intermediate 3072, vocab
151936, tied embeddings, q/k RMSNorm, no biases (Qwen3ForCausalLM). Saved with save_pretrained
(safetensors).
"""
from __future__ import annotations

import argparse
import pathlib
import time

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

QWEN3_06B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

#: shape name -> (transformers config class name, model class name, config fields)
SHAPES = {
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", QWEN25_05B),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_06B),
}


def build(out_dir, dtype: str = "bfloat16", layers: int | None = None, seed: int = 0,
          shape: str = "qwen2.5-0.5b") -> pathlib.Path:
    """Write the checkpoint of ``shape`` (a key of :data:`SHAPES`) to ``out_dir`` (skipped when
    config.json and weights exist). Raises KeyError naming the shapes for an unknown one."""
    import torch
    import transformers

    out = pathlib.Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    if shape not in SHAPES:
        raise KeyError(f"shape {shape!r}: expected one of {sorted(SHAPES)}")
    cfg_cls, model_cls, fields = SHAPES[shape]
    cfg = dict(fields)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = getattr(transformers, cfg_cls)(**cfg, bos_token_id=151643, eos_token_id=151643)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = getattr(transformers, model_cls)(config).eval()
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, "
          f"{dtype}) in {time.perf_counter() - t0:.0f} s")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ns = ap.parse_args()
    build(ns.out_dir, ns.dtype, ns.layers, shape=ns.shape)
