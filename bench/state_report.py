"""State report (issue 4 item 5; seed 000 PR07): per-token state bytes, scratch bytes, copies and
allocations over N decode steps of a converted Qwen model, for 1 and for 4 simultaneous
independent states on one session.

    python bench/state_report.py                          # builds a small random Qwen2 itself
    python bench/state_report.py --model /tmp/q05b_int4/model.onnx --steps 32

Every figure comes from the runtime's counters (``olv_runtime.counters``): the per-call
``state.last_counters`` of each decode call, summed over the decode calls of all states and
divided by the number of decoded tokens. Prefill calls are reported separately.

* state bytes / token: growth of the retained state (``retained_state_bytes``: the KV values'
  logical bytes) per decoded token; "state buffer bytes" are the capacity buffers behind them.
* scratch bytes: ``workspace_peak`` (peak bytes of activations alive at once in one call) and
  ``bytes_allocated`` per token (arrays allocated by the steps, KV buffers excluded).
* copies: ``bytes_copied_state`` (state management, must be 0), ``bytes_copied_kv_append``
  (the new token's K and V), ``bytes_copied_kv_prefix`` (KV growth/branch copies),
  ``bytes_copied_other``; ``model_serializations`` over construction and all calls (must be 0).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

import olv_runtime
from olv_runtime.counters import NAMES, PROCESS, Counters


def build_default_model(workdir: pathlib.Path) -> pathlib.Path:
    """A small random Qwen2 checkpoint converted to INT4 block-32 (no network)."""
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    ckpt = write_random_qwen2(workdir / "checkpoint", with_tokenizer=False, vocab_size=512)
    out = workdir / "model.onnx"
    olv_runtime.convert(ckpt, out, weights="int4-block32")
    return out


def run_config(session, n_states: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
    """Prefill ``n_states`` states, then ``steps`` decode calls each, interleaved call by call."""
    vocab = int(session.model.metadata().get("olv.vocab_size", "100"))
    rng = np.random.default_rng(seed)
    serial0 = PROCESS["model_serializations"]
    states = [olv_runtime.make_state(session, olv_runtime.empty_cache(session))
              for _ in range(n_states)]
    construction = Counters()
    for st in states:
        construction.merge(st.construction_counters)
    prefill, decode = Counters(), Counters()
    next_ids = []
    t0 = time.perf_counter()
    for st in states:
        ids = rng.integers(0, vocab, size=(1, prompt_len), dtype=np.int64)
        out = st.run({"input_ids": ids})
        prefill.merge(st.last_counters)
        next_ids.append(int(np.argmax(out["logits"][0, -1])))
    t_prefill = time.perf_counter() - t0
    after_prefill = [st.last_counters["retained_state_bytes"] for st in states]
    peak = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        for i, st in enumerate(states):
            out = st.run({"input_ids": np.array([[next_ids[i]]], np.int64)})
            c = st.last_counters
            decode.merge(c)
            peak = max(peak, c["workspace_peak"])
            next_ids[i] = int(np.argmax(out["logits"][0, -1]))
    t_decode = time.perf_counter() - t0
    final = [st.last_counters for st in states]
    tokens = steps * n_states
    d = decode.snapshot()
    report = {
        "states": n_states,
        "decode_tokens": tokens,
        "decode_tok_per_s": tokens / t_decode if t_decode else float("nan"),
        "prefill_tok_per_s": n_states * prompt_len / t_prefill if t_prefill else float("nan"),
        "state_bytes_per_token": sum(f["retained_state_bytes"] - a
                                     for f, a in zip(final, after_prefill)) / tokens,
        "state_bytes_total": sum(f["retained_state_bytes"] for f in final),
        "state_buffer_bytes_total": sum(f["retained_state_buffer_bytes"] for f in final),
        "workspace_peak": peak,
        "per_token": {k: d[k] / tokens for k in NAMES
                      if k not in ("workspace_peak", "retained_state_bytes",
                                   "retained_state_buffer_bytes")},
        "prefill": prefill.snapshot(),
        "construction": construction.snapshot(),
        "model_serializations": (PROCESS["model_serializations"] - serial0),
    }
    for st in states:
        st.close()
    return report


ROWS = [
    ("decode tok/s (all states)", lambda r: f"{r['decode_tok_per_s']:.1f}"),
    ("state bytes / token", lambda r: f"{r['state_bytes_per_token']:.0f}"),
    ("state bytes retained (end)", lambda r: f"{r['state_bytes_total']}"),
    ("state buffer bytes (KV capacity)", lambda r: f"{r['state_buffer_bytes_total']}"),
    ("scratch: workspace peak / call", lambda r: f"{r['workspace_peak']}"),
    ("scratch: bytes allocated / token", lambda r: f"{r['per_token']['bytes_allocated']:.0f}"),
    ("arrays allocated / token", lambda r: f"{r['per_token']['arrays_allocated']:.1f}"),
    ("copies: state management B/token", lambda r: f"{r['per_token']['bytes_copied_state']:.0f}"),
    ("copies: KV append B/token", lambda r: f"{r['per_token']['bytes_copied_kv_append']:.0f}"),
    ("copies: KV prefix B/token", lambda r: f"{r['per_token']['bytes_copied_kv_prefix']:.0f}"),
    ("copies: other B/token", lambda r: f"{r['per_token']['bytes_copied_other']:.0f}"),
    ("KV reallocations / token", lambda r: f"{r['per_token']['kv_reallocations']:.3f}"),
    ("bytes dequantized / token", lambda r: f"{r['per_token']['bytes_dequantized']:.0f}"),
    ("model serializations (setup+runs)", lambda r: f"{r['model_serializations']}"),
    ("state copies at construction", lambda r: f"{r['construction']['bytes_copied_state']}"),
    ("prefill: state copies / KV append B", lambda r: f"{r['prefill']['bytes_copied_state']} / "
                                                      f"{r['prefill']['bytes_copied_kv_append']}"),
]


def format_report(model_desc: str, reports: list[dict], prompt_len: int, steps: int) -> str:
    lines = [f"state report: {model_desc}",
             f"prompt {prompt_len} tokens per state, {steps} decode steps per state, "
             "states interleaved call by call on one session", ""]
    head = ["metric"] + [f"{r['states']} state{'s' if r['states'] > 1 else ''}" for r in reports]
    table = [head] + [[name] + [fmt(r) for r in reports] for name, fmt in ROWS]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for k, row in enumerate(table):
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(row)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="converted model (.onnx); default: build a small random Qwen2")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per state")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--states", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(args.model) if args.model else build_default_model(pathlib.Path(tmp))
        model = olv_runtime.load(path)
        serial0 = PROCESS["model_serializations"]
        session = olv_runtime.InferenceSession(
            model, olv_runtime.SessionOptions(num_threads=args.threads))
        meta = model.metadata()
        desc = (f"{path if args.model else 'random Qwen2 (built here)'}: "
                f"{meta.get('olv.num_layers')} layers, {meta.get('olv.num_kv_heads')} KV heads, "
                f"head_dim {meta.get('olv.head_dim')}, INT4 weights; session creation "
                f"model serializations {PROCESS['model_serializations'] - serial0}")
        run_config(session, 1, args.prompt_len, 2)  # warm-up (JIT)
        reports = [run_config(session, k, args.prompt_len, args.steps) for k in args.states]
        print(format_report(desc, reports, args.prompt_len, args.steps))
    bad = [r for r in reports if r["per_token"]["bytes_copied_state"] or r["model_serializations"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
