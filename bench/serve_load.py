"""Load against an OpenAI-compatible server: N concurrent streaming clients for a bounded time.

    python bench/serve_load.py --url http://127.0.0.1:8000 --clients 8 --seconds 30 \
        --prompt-tokens 128 --max-tokens 128 [--model NAME] [--api-key KEY] [--json out.json]
    python bench/serve_load.py plot serve.png olv=olv.json llama-cpp-python=lcp.json

Each client sends streamed completions (a prompt of ``--prompt-tokens`` token ids, so the server
needs no tokenizer and every server sees the same lengths; ``--text-prompt`` sends words instead,
for servers that take text only; ``--char-prompt`` sends ``--prompt-tokens`` random letters, which a
byte-level BPE tokenizer without merges -- bench/structured.py's ``synthetic_tokenizer`` -- encodes to
as many tokens in every server) back to back until ``--seconds`` have passed, then finishes its
request. Reported: aggregate generated tokens per second (chunks with text, or the usage counts
when the server sends them), time to first token and inter-token latency p50 / p99, requests
completed and errors. Works against ``olv serve`` and llama-cpp-python's server
(``python -m llama_cpp.server --model X.gguf``) alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _one(client, args, rng, stats):
    if args.char_prompt:  # one token per character under a byte-level BPE without merges
        prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                         for _ in range(args.prompt_tokens))
    elif args.text_prompt:
        prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                          for _ in range(args.prompt_tokens))
    else:
        prompt = [rng.randrange(10, args.vocab) for _ in range(args.prompt_tokens)]
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if args.model:
        body["model"] = args.model
    t0 = time.perf_counter()
    last, tokens, usage = None, 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            stats["errors"].append(f"{r.status_code}: {r.text[:200]}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                stats["errors"].append(str(obj["error"])[:200])
                return
            if obj.get("usage"):
                usage = obj["usage"]
            if not obj.get("choices") or not obj["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if last is None:
                stats["ttft"].append(now - t0)
            else:
                stats["itl"].append(now - last)
            last = now
            tokens += 1
    stats["tokens"] += usage["completion_tokens"] if usage else tokens
    stats["done"] += 1


async def _client(args, rng, stats, deadline):
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout,
                                 headers=headers) as client:
        while time.perf_counter() < deadline:
            try:
                await _one(client, args, rng, stats)
            except (httpx.HTTPError, ValueError) as exc:
                stats["errors"].append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.1)


async def run(args) -> dict:
    stats = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": []}
    t0 = time.perf_counter()
    deadline = t0 + args.seconds
    await asyncio.gather(*(_client(args, random.Random(i), stats, deadline)
                           for i in range(args.clients)))
    wall = time.perf_counter() - t0
    return {"url": args.url, "clients": args.clients, "seconds": round(wall, 2),
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "requests": stats["done"], "errors": len(stats["errors"]),
            "first_errors": stats["errors"][:3],
            "tok_per_s": round(stats["tokens"] / wall, 2),
            "ttft_p50_s": round(_pct(stats["ttft"], 0.5), 4),
            "ttft_p99_s": round(_pct(stats["ttft"], 0.99), 4),
            "itl_p50_s": round(_pct(stats["itl"], 0.5), 5),
            "itl_p99_s": round(_pct(stats["itl"], 0.99), 5),
            "itl_mean_s": round(statistics.fmean(stats["itl"]), 5) if stats["itl"] else None}


def plot(reports: dict, path: str) -> None:
    """Bars of aggregate tok/s and of TTFT p50 / p99 per server (``{label: report}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(reports)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.4))
    a1.bar(labels, [reports[k]["tok_per_s"] for k in labels], color=["C0", "C1", "C2"][:len(labels)])
    a1.set_ylabel("aggregate generated tok/s")
    x = range(len(labels))
    a2.bar([i - 0.2 for i in x], [reports[k]["ttft_p50_s"] for k in labels], 0.4, label="p50")
    a2.bar([i + 0.2 for i in x], [reports[k]["ttft_p99_s"] for k in labels], 0.4, label="p99")
    a2.set_xticks(list(x), labels)
    a2.set_ylabel("time to first token, s")
    a2.legend()
    c = next(iter(reports.values()))
    fig.suptitle(f"{c['clients']} streaming clients, prompt {c['prompt_tokens']}, "
                 f"{c['max_tokens']} tokens each")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["plot"]:  # bench/serve_load.py plot OUT.png LABEL=REPORT.json ...
        if len(argv) < 3 or not all("=" in a for a in argv[2:]):
            print("usage: serve_load.py plot OUT.png LABEL=REPORT.json [LABEL=REPORT.json ...]",
                  file=sys.stderr)
            return 2
        plot({a.split("=", 1)[0]: json.load(open(a.split("=", 1)[1])) for a in argv[2:]},
             argv[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1000,
                    help="prompt ids are drawn from [10, VOCAB) (default: 1000)")
    ap.add_argument("--text-prompt", action="store_true")
    ap.add_argument("--char-prompt", action="store_true",
                    help="a prompt of --prompt-tokens random letters (as many tokens for a "
                         "byte-level BPE without merges, the same for every server)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0:
        ap.error("--clients >= 1 and --seconds > 0")
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
