"""Build a random Qwen2.5-0.5B-shaped checkpoint locally (no download) with transformers.

    python bench/make_checkpoint.py OUT_DIR [--dtype bfloat16] [--layers 24]

Shape: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
embeddings, q/k/v biases (Qwen2ForCausalLM); saved with save_pretrained (safetensors).
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


def build(out_dir, dtype: str = "bfloat16", layers: int | None = None, seed: int = 0) -> pathlib.Path:
    """Write the checkpoint to ``out_dir`` (skipped when config.json and weights exist)."""
    import torch
    import transformers

    out = pathlib.Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    cfg = dict(QWEN25_05B)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = transformers.Qwen2Config(**cfg, bos_token_id=151643, eos_token_id=151643)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = transformers.Qwen2ForCausalLM(config).eval()
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
    ns = ap.parse_args()
    build(ns.out_dir, ns.dtype, ns.layers)
