"""``olv generate --batch FILE`` and ``olv bench --batch 1,2,4,...``: the batching engine
(:class:`olv_runtime.Engine`) from the command line."""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import time

import numpy as np

from olv_runtime.cli.chat import sampling_kwargs
from olv_runtime.cli.common import CliError, _session_options, _tokenizer_for
from olv_runtime.engine import Engine
from olv_runtime.executor.session import InferenceSession
from olv_runtime.generation.settings import GenerationConfig
from olv_runtime.io import load
from olv_runtime.progress import bar

#: ``--batch FILE``: read at most this many bytes and prompts (an untrusted file is bounded
#: before it is read into memory).
MAX_BATCH_FILE_BYTES = 64 << 20
MAX_BATCH_PROMPTS = 100_000


#: ``--json-schema FILE``: bytes read at most (the schema compiler's own limit is 200k characters)
MAX_SCHEMA_FILE_BYTES = 1 << 20


def read_json_schema(path: str):
    """``--json-schema FILE``: the JSON Schema in FILE (a dict), or True for '-' (any JSON
    object). CliError for a missing, oversized, non-UTF-8 or non-JSON file, or one whose top
    level is not an object."""
    if path == "-":
        return True
    p = pathlib.Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise CliError(f"--json-schema {path}: not a regular file")
        if size > MAX_SCHEMA_FILE_BYTES:
            raise CliError(f"--json-schema {path}: {size} bytes, over the "
                           f"{MAX_SCHEMA_FILE_BYTES} byte limit")
        schema = json.loads(p.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise CliError(f"--json-schema {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CliError(f"--json-schema {path}: not a JSON document ({str(exc)[:200]})") from None
    if not isinstance(schema, dict):
        raise CliError(f"--json-schema {path}: the schema must be a JSON object, got "
                       f"{type(schema).__name__}")
    return schema


def add_engine_options(q: argparse.ArgumentParser, positive) -> None:
    """The engine's sizes (``olv generate --batch``, ``olv bench --batch``)."""
    q.add_argument("--max-batch", type=positive, default=16,
                   help="--batch: requests decoded together at most (default: 16)")
    q.add_argument("--kv-cache-tokens", type=positive, default=None,
                   help="--batch: tokens of KV the engine's pool holds over all requests "
                        "(default: max-batch x min(context, 2048); bench: the largest batch's "
                        "prompts and new tokens)")
    q.add_argument("--kv-dtype", choices=["float32", "float16", "int8", "int4"], default="float32",
                   help="--batch: storage of the engine's KV pool (default: float32)")


def batch_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (each >= 1, at most 1024; argparse type)."""
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4,8, got {text!r}") \
            from None
    if not out or any(b < 1 or b > 1024 for b in out):
        raise argparse.ArgumentTypeError(f"batch sizes must be integers in [1, 1024], got {text!r}")
    return out


def _read_prompts(path: pathlib.Path) -> list[tuple[int, str]]:
    """The prompts of ``--batch FILE`` with their line numbers (1-based): lines end at "\\n"
    (a "\\r" before it is dropped) and nowhere else -- a form feed or a U+2028 inside a line
    stays in its prompt; blank lines are skipped."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CliError(f"--batch {path}: {exc.strerror or exc}") from None
    if not path.is_file():
        raise CliError(f"--batch {path}: not a regular file")
    if size > MAX_BATCH_FILE_BYTES:
        raise CliError(f"--batch {path}: {size} bytes, over the {MAX_BATCH_FILE_BYTES} byte limit")
    try:  # at most the limit + 1 bytes: a file that grew (or a /proc file, size 0) is bounded
        with path.open("rb") as fh:
            data = fh.read(MAX_BATCH_FILE_BYTES + 1)
    except OSError as exc:
        raise CliError(f"--batch {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_BATCH_FILE_BYTES:
        raise CliError(f"--batch {path}: over the {MAX_BATCH_FILE_BYTES} byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"--batch {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") \
            from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    if len(lines) > MAX_BATCH_PROMPTS:
        raise CliError(f"--batch {path}: {len(lines)} lines, over the {MAX_BATCH_PROMPTS} "
                       "prompt limit")
    prompts = [(i + 1, ln.removesuffix("\r")) for i, ln in enumerate(lines)
               if ln.strip()]
    if not prompts:
        raise CliError(f"--batch {path}: no prompt (one prompt per line)")
    return prompts


def _engine(model, args, tokenizer=None) -> Engine:
    """The engine of a command; its warnings (a model whose requests run one by one) are
    printed on stderr once, as one line."""
    sess = InferenceSession(model, _session_options(args))
    logger = logging.getLogger("olv_runtime.engine")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        return Engine(sess, max_batch=args.max_batch, kv_cache_tokens=args.kv_cache_tokens,
                      kv_dtype=args.kv_dtype, tokenizer=tokenizer)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def cmd_generate_batch(args) -> int:
    """``olv generate MODEL --batch FILE``: one prompt per line, one JSON object per prompt on
    stdout (in input order): index, text, ids, finish_reason, prompt_tokens, cached_tokens."""
    if getattr(args, "prompt_cache", None):
        raise CliError("--prompt-cache is for one prompt: it cannot be used with --batch")
    prompts = _read_prompts(pathlib.Path(args.batch))
    model = load(args.model)
    tokenizer = _tokenizer_for(model)
    if tokenizer is None:
        raise CliError(f"--batch needs tokenizer.json beside the model "
                       f"({pathlib.Path(args.model).parent})")
    ids = []
    for line, p in prompts:
        enc = tokenizer.encode(p).ids
        if not enc:
            raise CliError(f"--batch line {line}: the prompt encodes to zero tokens")
        ids.append(enc)
    kw = sampling_kwargs(args)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                              skip_special_tokens=not args.special,
                              logprobs=bool(args.logprobs), top_logprobs=args.logprobs, **kw)
    eng = _engine(model, args, tokenizer)
    t0 = time.perf_counter()
    seen = [0]

    def advance(done, total):
        progress.update(done - seen[0])
        seen[0] = done

    with bar(len(ids), "generate", "prompt") as progress:
        results = eng.generate(ids, config, progress=advance)
    dt = time.perf_counter() - t0
    for i, r in enumerate(results):
        rec = {"index": i, "text": r.text, "ids": r.ids.tolist(), "finish_reason": r.finish_reason,
               "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}
        if r.logprobs is not None:
            rec["logprobs"] = [lp.logprob for lp in r.logprobs]
        if r.error is not None:
            rec["error"] = str(r.error)
        print(json.dumps(rec, ensure_ascii=False))
    st = eng.stats()
    print(f"{len(ids)} prompts in {dt:.2f} s: {st.generated_tokens} tokens generated "
          f"({st.generated_tokens / max(dt, 1e-9):.1f} tok/s aggregate), {st.steps} steps, "
          f"{st.preemptions} preemptions, {st.prefix_hit_tokens} prompt tokens from the prefix "
          f"cache", file=sys.stderr)
    return 0


def _decode_rate(eng: Engine, prompts, config) -> tuple[float, float]:
    """Aggregate (prefill tok/s, decode tok/s) of one batch: the prompts are prefilled
    together, then the decode steps are timed."""
    rids = [eng.add_request(p, config) for p in prompts]
    t0 = time.perf_counter()
    while any(eng.requests[r].computed < len(prompts[0]) for r in rids):
        eng.step()
    t1 = time.perf_counter()
    n0 = eng.stats().generated_tokens
    while eng.has_unfinished():
        eng.step()
    t2 = time.perf_counter()
    n = eng.stats().generated_tokens - n0
    for r in rids:
        eng.result(r)
    return len(prompts) * len(prompts[0]) / (t1 - t0), n / max(t2 - t1, 1e-9)


def cmd_bench_batch(args) -> int:
    """``olv bench MODEL --batch 1,2,4,8``: aggregate and per-sequence decode tok/s per batch
    size through the engine (random prompts of --prompt-len, --new-tokens each)."""
    model = load(args.model)
    sizes = args.batch
    max_batch = max(args.max_batch, max(sizes))
    kv_tokens = args.kv_cache_tokens  # default: what the largest batch holds, no more
    if kv_tokens is None:
        kv_tokens = max(sizes) * (args.prompt_len + max(args.new_tokens, 2))
    eng = _engine(model, argparse.Namespace(**{**vars(args), "max_batch": max_batch,
                                                "kv_cache_tokens": kv_tokens}))
    vocab = int(model.metadata().get("olv.vocab_size", "100"))
    rng = np.random.default_rng(0)
    config = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None,
                              context_limit=args.context_limit)
    print(f"bench --batch {args.model}: prompt {args.prompt_len}, {args.new_tokens} new tokens "
          f"per sequence, batch sizes {sizes}, {args.runs} runs (+1 warm-up), activations "
          f"{'int8' if args.quantize_activations else 'float32 (exact)'}", file=sys.stderr)
    _decode_rate(eng, [rng.integers(0, vocab, args.prompt_len).tolist()],
                 GenerationConfig(max_new_tokens=2, eos_token_id=None))  # warm-up
    print(f"{'B':>4} {'prefill tok/s':>14} {'decode tok/s':>13} {'per seq':>8}")
    with bar(len(sizes) * args.runs, "bench", "run") as progress:
        for b in sizes:
            pre, dec = [], []
            for _ in range(args.runs):
                prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)]
                p, d = _decode_rate(eng, prompts, config)
                pre.append(p)
                dec.append(d)
                progress.update(1)
            d = statistics.median(dec)
            progress.write(f"{b:>4} {statistics.median(pre):>14.1f} {d:>13.1f} {d / b:>8.1f}")
    return 0
