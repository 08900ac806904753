"""Batched decode: aggregate and per-sequence tok/s of olv's batching engine against batch size.

    python bench/batch.py [--model OLV.onnx] [--batch 1,2,4,8,16,32] [--prompt-len 128]
                          [--new-tokens 64,128] [--threads 2] [--modes exact,int8]
                          [--ik-batched-bench PATH --gguf Q4_0.gguf] [--plot batch.png]
                          [--json out.json]

Without ``--model`` the Qwen2.5-0.5B-shaped INT4 model of bench/decode.py's cache is used
(``~/.cache/olv_bench/q05b_int4/model.onnx``; run bench/decode.py once to build it).

Each mode (exact: float activations; int8: ``quantize_activations``) runs in its own subprocess
(``--phase``). Per batch size B: B requests of ``--prompt-len`` random ids are added at once and
prefilled together (chunked prefill, ``--max-tokens-per-step``), then the decode steps are timed
until each has ``--new-tokens`` tokens. Figures: aggregate decode tok/s (tokens / decode wall
time), per-sequence tok/s (aggregate / B), TTFT under load (a request added while B-1 others
decode: seconds to its first token), KV bytes per sequence (pool bytes per token x (prompt + new
tokens)). The row "generate" is :func:`olv_runtime.generate` on one sequence (the engine's B = 1
is compared with it: the issue's "no tax for the scheduler"); its runs alternate with the B = 1
runs (one generate run before each), since this VM's memory bandwidth drifts between phases
minutes long and a decode at B = 1 is bound by it. For the same reason the ``--runs`` are rounds:
each round runs every batch size once, so the ratios between batch sizes (B = 8 / B = 1) compare
runs of the same few minutes; the figures are the medians over the rounds.

Peers (never in CI): ``--ik-batched-bench`` runs ik_llama.cpp's ``llama-batched-bench -m GGUF
-npp P -ntg N -npl B1,B2,.. -t T -rtr`` and reads its S_TG column (aggregate generation
tok/s; ``-rtr``: its run-time repacking into the interleaved layouts); the GGUF should hold the
same weights (bench/gguf_export.py writes the olv model's INT4 codes as Q4_0). ``--llama-cpp``
runs llama.cpp through llama-cpp-python's low-level batch API on the same GGUF, as
``llama-batched-bench`` does: per B a context of ``B * (P + N)`` tokens with ``n_seq_max = B``,
each prompt prefilled as its own sequence, then ``N`` steps (after one untimed) of one
``llama_batch`` holding one token per sequence (``seq_id`` = the sequence), each step's next
tokens the argmax of its logits; S_TG = B * N / the steps' wall time
(``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36``; its own subprocess).

Shared machines: the "other load" column is the CPU other processes used during the phase (the
phase's own children, such as the session's compile worker, are shown apart beside it; 2
threads on 2 cores: any other busy process stalls every parallel region); compare figures of one
run, as ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from olv_runtime.cli.batch import _decode_rate

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_MODEL = pathlib.Path("~/.cache/olv_bench/q05b_int4/model.onnx").expanduser()


def _cpu_busy():
    f = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return f[0] + f[1] + f[2] + f[5] + f[6]


def _own_cpu():
    """``(this process, its children)`` CPU seconds; the children: the ones it has waited for
    (os.times) and the live ones (/proc: the session's compile worker). A child reaped between
    the two reads is missed by both (a few ms)."""
    t = os.times()
    kids = t.children_user + t.children_system
    me = str(os.getpid())
    tick = os.sysconf("SC_CLK_TCK")
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f[1] == me:  # ppid
            kids += (int(f[11]) + int(f[12])) / tick  # utime, stime
    return t.user + t.system, kids


def _decode(eng, prompts, config):
    """(aggregate decode tok/s, prefill tok/s) of one batch added at once (the measurement of
    ``olv bench --batch``)."""
    prefill, decode = _decode_rate(eng, prompts, config)
    return decode, prefill


def _ttft(eng, prompts, config):
    """Seconds from adding one more request to its first token while the others decode."""
    from olv_runtime import GenerationConfig

    rids = [eng.add_request(p, config) for p in prompts[:-1]]
    for _ in range(4):
        eng.step()
    t0 = time.perf_counter()
    late = eng.add_request(prompts[-1], GenerationConfig(max_new_tokens=1, eos_token_id=None))
    while not eng.requests[late].finished:
        eng.step()
    dt = time.perf_counter() - t0
    for r in rids:
        eng.cancel(r)
    while eng.has_unfinished():
        eng.step()
    for r in rids + [late]:
        eng.result(r)
    return dt


def phase(args) -> dict:
    """One mode in this process: the generate row and every batch size."""
    import olv_runtime
    from olv_runtime import Engine, GenerationConfig, SessionOptions

    int8 = args.phase == "int8"
    sess = olv_runtime.InferenceSession(olv_runtime.load(args.model), SessionOptions(
        quantize_activations=int8, num_threads=args.threads))
    vocab = int(sess.get_modelmeta()["olv.vocab_size"])
    rng = np.random.default_rng(0)
    sizes = [int(b) for b in args.batch.split(",")]
    news = [int(n) for n in args.new_tokens.split(",")]
    ctx = args.prompt_len + max(news) + 8
    eng = Engine(sess, max_batch=max(sizes), kv_cache_tokens=max(sizes) * ctx,
                 max_tokens_per_step=args.max_tokens_per_step)
    out = {"mode": args.phase, "batched": eng.batched, "fallback": eng.fallback_reason,
           "rows": []}
    busy0, own0, w0 = _cpu_busy(), _own_cpu(), time.time()
    warm = GenerationConfig(max_new_tokens=4, eos_token_id=None)
    # warm-up: a batch, then each of the two B = 1 measurements, twice (the compile worker's
    # entries are taken over by the first calls; the first measured point then runs warm)
    _decode(eng, [rng.integers(0, vocab, args.prompt_len).tolist()] * 2, warm)
    for _ in range(2):
        olv_runtime.generate_result(sess, rng.integers(0, vocab, args.prompt_len).tolist(), warm)
        _decode(eng, [rng.integers(0, vocab, args.prompt_len).tolist()], warm)
    for new in news:
        cfg = GenerationConfig(max_new_tokens=new, eos_token_id=None)
        gen = []

        def gen_run():
            st = olv_runtime.GenerationStats()
            olv_runtime.generate_result(sess, rng.integers(0, vocab, args.prompt_len).tolist(),
                                        cfg, stats=st)
            gen.append(st.decode_tokens_per_second)
        if 1 not in sizes:
            for _ in range(args.runs):
                gen_run()
        grow = {"B": "generate", "new": new, "decode": None}
        out["rows"].append(grow)
        # rounds: each round runs every batch size once (generate before B = 1), so the ratios
        # between batch sizes compare runs minutes apart at most, not a whole sweep apart (the
        # VM's memory bandwidth drifts by the minute; B = 1 is bound by it, large B is not)
        dec = {b: [] for b in sizes}
        pre = {b: [] for b in sizes}
        for _ in range(args.runs):
            for b in sizes:
                if b == 1:  # generate's runs alternate with B = 1's: the pair sees the same
                    gen_run()  # machine
                prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)]
                d, p = _decode(eng, prompts, cfg)
                dec[b].append(d)
                pre[b].append(p)
        for b in sizes:
            prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)]
            ttft = _ttft(eng, prompts, cfg)
            kv = eng.pool.bytes_per_token() * (args.prompt_len + new) if eng.pool else None
            out["rows"].append({"B": b, "new": new, "decode": statistics.median(dec[b]),
                                "decode_runs": dec[b],
                                "prefill": statistics.median(pre[b]), "ttft": ttft,
                                "kv_bytes_per_seq": kv})
            print(json.dumps(out["rows"][-1]), file=sys.stderr, flush=True)
        grow["decode"] = statistics.median(gen)  # (B = 1 may come anywhere in --batch)
        grow["decode_runs"] = gen
    wall = time.time() - w0
    own1 = _own_cpu()
    ncpu = os.cpu_count() or 1
    kids = own1[1] - own0[1]
    other = (_cpu_busy() - busy0) / os.sysconf("SC_CLK_TCK") - (own1[0] - own0[0]) - kids
    out["other_load"] = max(0.0, other / wall / ncpu)
    # the phase's own children (the compile worker) compete for the same cores: shown apart
    out["child_load"] = max(0.0, kids / wall / ncpu)
    return out


def ik_batched(args) -> dict:
    """ik_llama.cpp's llama-batched-bench: {B: S_TG} (aggregate generation tok/s)."""
    ntg = int(args.new_tokens.split(",")[0])
    ctx = max(int(b) for b in args.batch.split(",")) * (args.prompt_len + ntg) + 64
    cmd = [args.ik_batched_bench, "-m", args.gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(args.prompt_len), "-ntg", str(ntg), "-npl", args.batch, "-t",
           str(args.threads), "-rtr"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
    txt = r.stdout + r.stderr  # the table goes to stderr
    out = {}
    for line in txt.splitlines():  # |    PP |     TG |    B |   N_KV | ... |  S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2] or ""):
            out[int(cells[2])] = float(cells[7])
    return out


def llama_batched(args) -> dict:
    """llama.cpp (llama-cpp-python's low-level API): {B: S_TG} (see the module docstring)."""
    import ctypes

    import llama_cpp as L

    L.llama_backend_init()
    # silence llama.cpp's log (thousands of lines per context on stderr)
    log_cb = L.llama_log_callback(lambda level, text, user: None)
    L.llama_log_set(log_cb, ctypes.c_void_p())
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.gguf.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.gguf}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    ntg = int(args.new_tokens.split(",")[0])
    pp = args.prompt_len
    rng = np.random.default_rng(0)
    out = {}
    for b in (int(x) for x in args.batch.split(",")):
        cp = L.llama_context_default_params()
        cp.n_ctx = b * (pp + ntg) + 64
        cp.n_batch = cp.n_ubatch = max(pp, b, 512)
        cp.n_seq_max = b
        cp.n_threads = cp.n_threads_batch = args.threads
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = True  # one cache for all sequences, as llama-batched-bench -kvu
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit(f"llama.cpp could not make a context for B = {b}")
        batch = L.llama_batch_init(max(pp, b), 0, b)

        def fill(tokens, positions, seqs, logits):
            for i, (t, p_, s_, lg) in enumerate(zip(tokens, positions, seqs, logits)):
                batch.token[i] = int(t)
                batch.pos[i] = int(p_)
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = int(s_)
                batch.logits[i] = int(lg)
            batch.n_tokens = len(tokens)

        for s_ in range(b):  # prefill: each prompt its own sequence
            fill(rng.integers(3, n_vocab, pp), range(pp), [s_] * pp, [0] * (pp - 1) + [1])
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed (prefill)")
        toks = rng.integers(3, n_vocab, b)
        t0 = None
        for step in range(ntg + 1):  # the first step untimed (warm-up, as llama-batched-bench)
            if step == 1:
                t0 = time.perf_counter()
            fill(toks, [pp + step] * b, range(b), [1] * b)
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed (generation)")
            logits = L.llama_get_logits(ctx)
            arr = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)),
                                        shape=(b, n_vocab))
            toks = arr.argmax(axis=1)  # greedy, as a decode loop would
        out[b] = b * ntg / (time.perf_counter() - t0)
        print(json.dumps({"llama.cpp B": b, "S_TG": out[b]}), file=sys.stderr, flush=True)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    L.llama_model_free(model)
    return out


def table(results, ik, llama=None, peer_new=None) -> str:
    """The markdown table; the peers' columns only on the rows of ``peer_new`` new tokens (the
    peers run the first ``--new-tokens`` value only; None: every row)."""
    head = ("| mode | new | B | aggregate decode tok/s | per seq | x B=1 | x generate | "
            "prefill tok/s | TTFT s | KV MiB/seq | ik S_TG | x ik | llama.cpp S_TG | x llama.cpp |")
    lines = [head,
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for new in sorted({r["new"] for r in res["rows"]}):
            rows = [r for r in res["rows"] if r["new"] == new]
            gen = next(r["decode"] for r in rows if r["B"] == "generate")
            one = next((r["decode"] for r in rows if r["B"] == 1), None)
            for r in rows:
                if r["B"] == "generate":
                    lines.append(f"| {res['mode']} | {new} | generate | {gen:.1f} | | | 1.00 "
                                 "| | | | | | | |")
                    continue
                d = r["decode"]
                peers = peer_new is None or new == peer_new
                k = ik.get(r["B"]) if ik and peers else None
                lc = llama.get(r["B"]) if llama and peers else None
                kv = r["kv_bytes_per_seq"]
                lines.append(
                    f"| {res['mode']} | {new} | {r['B']} | {d:.1f} | {d / r['B']:.1f} | "
                    + (f"{d / one:.2f}" if one else "") + f" | {d / gen:.2f} | "
                    f"{r['prefill']:.1f} | {r['ttft']:.3f} | "
                    f"{kv / 2**20:.1f} | " + (f"{k:.1f} | {d / k:.2f} |" if k else " | |")
                    + (f" {lc:.1f} | {d / lc:.2f} |" if lc else " | |"))
    loads = ", ".join(f"{r['mode']} {100 * r['other_load']:.0f} % (its own compile worker "
                      f"{100 * r.get('child_load', 0.0):.0f} %)" for r in results)
    return "\n".join(lines) + f"\n\nother load during the phases: {loads}"


def plot(results, path, ik=None, llama=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for res in results:
        new = min(r["new"] for r in res["rows"])
        rows = [r for r in res["rows"] if r["new"] == new and r["B"] != "generate"]
        ax.plot([r["B"] for r in rows], [r["decode"] for r in rows], marker="o",
                label=f"olv {res['mode']} (aggregate)")
    if ik:
        bs = sorted(ik)
        ax.plot(bs, [ik[b] for b in bs], marker="s", linestyle="--",
                label="ik_llama.cpp S_TG (same Q4_0 weights)")
    if llama:
        bs = sorted(llama)
        ax.plot(bs, [llama[b] for b in bs], marker="^", linestyle=":",
                label="llama.cpp 0.3.36 S_TG (llama-cpp-python batch API)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (sequences)")
    ax.set_ylabel("decode tok/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--batch", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", default="64,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1, help="measured runs per point (median)")
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--modes", default="exact,int8")
    ap.add_argument("--ik-batched-bench", default=None, metavar="PATH")
    ap.add_argument("--gguf", default=None, help="the GGUF the peers read (same weights)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also llama.cpp through llama-cpp-python's batch API (needs --gguf)")
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", default=None)
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase == "llama":
        print(json.dumps({str(b): v for b, v in llama_batched(args).items()}))
        return 0
    if args.phase:
        print(json.dumps(phase(args)))
        return 0
    if not pathlib.Path(args.model).is_file():
        print(f"no model at {args.model}: run bench/decode.py once, or pass --model",
              file=sys.stderr)
        return 2
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--phase", mode] + [
            a for a in (argv if argv is not None else sys.argv[1:])]
        print(f"phase {mode} ...", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    ik = ik_batched(args) if args.ik_batched_bench and args.gguf else None
    llama = None
    if args.llama_cpp and args.gguf:
        cmd = [sys.executable, __file__, "--phase", "llama"] + [
            a for a in (argv if argv is not None else sys.argv[1:])]
        print("phase llama.cpp ...", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        llama = {int(b): v for b, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
    print(table(results, ik, llama, peer_new=int(args.new_tokens.split(",")[0])))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"olv": results, "ik": ik,
                                                       "llama.cpp": llama}, indent=1))
    if args.plot:
        plot(results, args.plot, ik, llama)
    return 0


if __name__ == "__main__":
    sys.exit(main())
