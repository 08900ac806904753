"""End-to-end decode benchmark: olv_runtime against onnxruntime, transformers and llama.cpp on the
same weights, prompt ids and thread count, each backend in its own subprocess.

    python bench/decode.py [--checkpoint DIR] [--model OLV.onnx] [--prompt-len 32]
                           [--new-tokens 64] [--runs 3] [--threads 2] [--prefill-lens 128,512]

Without ``--checkpoint``/``--model`` the Qwen2.5-0.5B-shaped random bf16 checkpoint is built with
bench/make_checkpoint.py into the cache dir (``--cache-dir``, default ``$OLV_BENCH_CACHE`` or
``~/.cache/olv_bench``) and converted there with ``olv convert --weights int4-block32``. The
onnxruntime models are exported from the olv model's INT4 values by bench/ort_export.py (same
codes and scales; the graph contract is printed in the row label).

Phases (each a fresh ``python bench/decode.py --phase ...`` subprocess, run one after another):

* ``bandwidth``: 2-thread (``--threads``) streaming read over 1 GiB: the fastest of the read kernels of bench/_bandwidth.py (vectorised float32 / uint32 sums, numpy.sum), best
  of 7;
* ``olv`` exact (float activations) and ``olv`` quantize_activations (int8 activation blocks);
* ``olv-c`` / ``olv-qc``: the same two on the model's seed 004 compiled copy (persisted prepacked
  weights, issue 14): ``olv compile`` runs once into ``<cache>/compiled/<tag>/model.onnx`` and is
  reused while newer than the model and written for this CPU's device descriptor; the rows print
  the compiled hits / misses, session creation time and peak RSS (the issue-14 RSS column);
* ``ort`` on the MatMulNBits graph at accuracy_level 4 (int8 activations, like llama.cpp) and
  at the default level 0 (float activations); the prompt logits of each are compared with
  olv exact (max abs difference; the same check is printed for olv quantized);
* ``torch``: transformers fp32 on the bf16 checkpoint (different numerics: fp32 weights);
* ``llama``: llama.cpp on a Q4_0 GGUF holding the olv INT4 codes (bench/gguf_export.py; the
  float32 block scales become Q4_0's float16), only if ``llama_cpp`` imports (untested here:
  llama-cpp-python is not installed on this machine);
* ``ttft``: olv_runtime time to first token from a fresh interpreter, twice, with
  ``NUMBA_CACHE_DIR`` pointed at a new empty directory (first: compile, second: cache hit);
* ``overhead``: olv exact decode with every plan step's ``fn`` replaced by a function returning
  preallocated outputs (captured from one real decode step): what remains is the executor,
  state bookkeeping and the generate loop (including argmax over the logits).

Measurements per backend: prefill tok/s of the ``--prompt-len`` prompt (median over runs),
prefill tok/s of a separate ``--prefill-len`` prompt (median), decode tok/s (tokens after the
first / decode wall time; median of ``--runs`` runs after one warm-up run), peak RSS of the phase
(``ru_maxrss``), weight bytes read per decode token (linear weights incl. lm_head, as that
backend stores them), achieved GB/s = (weight bytes + mean KV bytes read) x decode tok/s, and the
bound tok/s = streaming bandwidth / weight bytes. Greedy decoding, no EOS stop. ``--json`` writes
every figure.

Shared machines: with 2 threads on 2 cores, any other busy process stalls every parallel region
by a scheduler time slice, which can halve a figure. Each phase therefore records the CPU other
processes used while it ran (the "other load" column); before a phase the script waits up to
``--wait-idle`` seconds (default 30) for the machine to be quiet, and a phase measured under more
than 10 % other load is re-run ``--retry-busy`` times (default 1; the ttft phase is never re-run,
its first run must find an empty cache), keeping the least disturbed result.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


# ================================================================================================
# helpers shared by phases
# ================================================================================================
def peak_rss() -> int:
    """Peak resident set of this process (VmHWM: per address space, so unlike ru_maxrss it does
    not inherit the parent's peak across fork/exec)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prompt_ids(n: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int64)


def kv_bytes_per_token(spec) -> float:
    """Mean KV-cache bytes read per decode token (float32 K and V, mean context)."""
    ctx = spec["prompt_len"] + spec["new_tokens"] / 2
    return 2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * 4 * ctx


def _median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


# ================================================================================================
# phases (run in subprocesses)
# ================================================================================================
def above_bound(rate, bound):
    from _bandwidth import above_bound as ab

    return ab(rate, bound)


def phase_bandwidth(spec):
    import numba
    from _bandwidth import check_vectorised, stream_bandwidth

    from olv_runtime.kernels import config

    numba.set_num_threads(spec["threads"])
    nbytes = 1 << 30
    best, med, variants = stream_bandwidth(nbytes, 7, numba.get_num_threads(), detail=True)
    return {"gbps_best": best, "gbps_median": med, "variants": variants,
            "vectorised": check_vectorised(), "bytes": nbytes,
            "threads": numba.get_num_threads(), "layer": config.threading_layer()}


def _prefill_lens(spec):
    return [int(x) for x in spec["prefill_lens"]]


def _measure_prefills(spec, one):
    """{length: median prefill tok/s} of ``one(ids) -> prefill seconds`` over ``runs`` runs for
    every length of ``--prefill-lens`` (prompt ids seeded by the length)."""
    out = {}
    for ln in _prefill_lens(spec):
        ids = prompt_ids(ln, spec["vocab"], ln)
        one(ids)  # warm-up (shapes of this length)
        out[str(ln)] = _median([ln / one(ids) for _ in range(spec["runs"])])
    return out


def _olv_session(spec, quantize):
    import olv_runtime

    model = olv_runtime.load(spec["model"])
    opts = olv_runtime.SessionOptions(num_threads=spec["threads"], quantize_activations=quantize)
    return olv_runtime.InferenceSession(model, opts)


def _olv_weight_bytes(sess) -> int:
    total = 0
    for st in sess.all_steps():
        impl = st.impl
        if st.kind == "Linear":
            if getattr(impl, "packed", None) is not None:
                total += impl.packed.nbytes
            elif getattr(impl, "dense", None) is not None:
                total += impl.dense.nbytes
            else:
                total += sum(w.nbytes for w in impl.weights)
        elif st.kind == "Decode":  # no native consumer: decoded every call (GGUF Q6_K, F16)
            w = sess._constants.get(st.inputs[0])
            total += getattr(w, "nbytes", 0)
    return total


def phase_olv(spec):
    import olv_runtime
    from olv_runtime.kernels import threading_layer
    from olv_runtime.state import empty_cache, make_state

    quantize = spec["quantize"]
    t0 = time.perf_counter()
    sess = _olv_session(spec, quantize)
    t_session = time.perf_counter() - t0
    prompt = prompt_ids(spec["prompt_len"], spec["vocab"], 0)
    n = spec["new_tokens"]
    # prompt logits (correctness check against the other backends)
    st = make_state(sess, empty_cache(sess))
    logits = np.array(st.run({"input_ids": prompt.reshape(1, -1)})["logits"])
    st.close()
    np.save(spec["logits_out"], logits)
    # warm-up (numba dispatch, KV buffers), then measured runs
    olv_runtime.generate(sess, prompt, n)
    pf, dec, tt, toks = [], [], [], None
    before = sess.counters.snapshot()
    for _ in range(spec["runs"]):
        s = olv_runtime.GenerationStats()
        stamps = []
        toks = olv_runtime.generate(sess, prompt, n, stats=s,
                                    callback=lambda tok: stamps.append(time.perf_counter()))
        pf.append(s.prefill_tokens_per_second)
        dec.append(s.decode_tokens_per_second)
        tt += [b - a for a, b in zip(stamps, stamps[1:])]
    after = sess.counters.snapshot()

    def one(ids):
        s = olv_runtime.GenerationStats()
        olv_runtime.generate(sess, ids, 1, stats=s)
        return s.prefill_seconds
    pf_by = _measure_prefills(spec, one)
    # allocations per decode step (counters snapshotted by the per-token callback of generate:
    # the difference between two consecutive callbacks is exactly one decode step)
    snaps = []
    olv_runtime.generate(sess, prompt, n, callback=lambda tok: snaps.append(sess.counters.snapshot()))
    arr = [b["arrays_allocated"] - a["arrays_allocated"] for a, b in zip(snaps, snaps[1:])]
    byt = [b["bytes_allocated"] - a["bytes_allocated"] for a, b in zip(snaps, snaps[1:])]
    alloc = {"decode_steps": len(arr), "arrays": sum(arr), "bytes": sum(byt),
             "first_step_arrays": arr[0] if arr else 0,
             "later_steps_arrays": sum(arr[1:]), "later_steps_bytes": sum(byt[1:]),
             "max_per_step": max(arr) if arr else 0}
    return {
        "prefill_tps": _median(pf), "prefill_by_len": pf_by,
        "decode_tps": 1.0 / _median(tt), "decode_runs": dec, "prefill_runs": pf,
        "rss": peak_rss(), "weight_bytes": _olv_weight_bytes(sess),
        "session_seconds": t_session, "threading_layer": threading_layer(),
        "tokens": [int(t) for t in toks[:8]],
        "decode_allocations": alloc,
        "bytes_dequantized": after["bytes_dequantized"] - before["bytes_dequantized"],
        "plan_steps": len(sess._steps),
        "compiled_hits": after["compiled_hits"], "compiled_misses": after["compiled_misses"],
    }


def phase_ttft(spec):
    """Run in a fresh interpreter: import, load, session, first token (wall-clock stamps)."""
    t_start = time.time()
    import olv_runtime

    t_import = time.time()
    model = olv_runtime.load(spec["model"])
    sess = olv_runtime.InferenceSession(
        model, olv_runtime.SessionOptions(num_threads=spec["threads"],
                                          quantize_activations=spec["quantize"]))
    t_session = time.time()
    olv_runtime.generate(sess, prompt_ids(spec["prompt_len"], spec["vocab"], 0), 1)
    t_first = time.time()
    return {"t_start": t_start, "import": t_import - t_start, "session": t_session - t_import,
            "first_generate": t_first - t_session, "t_first": t_first}


def phase_overhead(spec):
    """Executor overhead: the decode loop with every kernel replaced by a no-op.

    A compiled ``DecoderStack`` step keeps its Python (KV claim, argument passing) and only its
    compiled driver call (``run_kernel``) becomes a no-op. When the session runs decode tokens
    through its decode program (``InferenceSession.decode_program``: embedding row, RoPE rows,
    compiled step) the other two steps stay as they are: their kernels (one row gather, a
    table lookup of the RoPE rows) count as overhead. Otherwise plain steps' ``fn`` are replaced
    by functions returning outputs captured from a real decode step. What remains is the
    executor, the Python around the kernels, state bookkeeping and the generate loop
    (including argmax over the logits)."""
    import olv_runtime
    from olv_runtime.state import empty_cache, make_state

    sess = _olv_session(spec, spec["quantize"])
    prompt = prompt_ids(spec["prompt_len"], spec["vocab"], 0)
    n = spec["new_tokens"]
    olv_runtime.generate(sess, prompt, n)
    stacks = [st.impl for st in sess._steps if st.kind == "DecoderStack"]
    program = getattr(sess, "decode_program", lambda: None)() if stacks else None
    if program is not None:
        real_kernels = [s.run_kernel for s in stacks]
        real, noop = [], []
        for s in stacks:
            s.run_kernel = lambda *a: None
        olv_runtime.generate(sess, prompt, n)  # warm-up of the no-op path
        for _ in range(spec["runs"]):  # interleaved, so both see the same machine conditions
            for nk, acc in ((False, real), (True, noop)):
                for s, k in zip(stacks, real_kernels):
                    s.run_kernel = (lambda *a: None) if nk else k
                s_ = olv_runtime.GenerationStats()
                olv_runtime.generate(sess, prompt, n, stats=s_)
                acc.append(s_.decode_seconds / max(n - 1, 1))
        for s, k in zip(stacks, real_kernels):
            s.run_kernel = k
        return {"real_s_per_token": _median(real), "noop_s_per_token": _median(noop),
                "steps": len(sess._steps), "kinds": sorted({s.kind for s in sess._steps}),
                "compiled_stack": True, "decode_program": True}
    # capture every plain step's outputs during one real decode step
    st = make_state(sess, empty_cache(sess))
    logits = st.run({"input_ids": prompt.reshape(1, -1)})["logits"]
    captured = {}
    originals = {id(step): step.fn for step in sess._steps}
    for step in sess._steps:
        def rec(*args, _fn=step.fn, _id=id(step)):
            res = _fn(*args)
            captured[_id] = tuple(np.array(r, copy=True) if isinstance(r, np.ndarray) else r
                                  for r in res)
            return res
        step.fn = rec
    st.run({"input_ids": np.array([[int(np.argmax(logits[0, -1]))]], np.int64)})
    st.close()
    noops = {id(step): (step.fn if step.kind == "DecoderStack" else
                        (lambda *a, _o=captured[id(step)]: _o)) for step in sess._steps}
    for step in sess._steps:
        if step.kind == "DecoderStack":
            noops[id(step)] = originals[id(step)]
    real_kernels = [s.run_kernel for s in stacks]

    def use(fns, noop_kernels):
        for step in sess._steps:
            step.fn = fns[id(step)]
        for s, k in zip(stacks, real_kernels):
            s.run_kernel = (lambda *a: None) if noop_kernels else k

    real, noop = [], []
    use(noops, True)
    olv_runtime.generate(sess, prompt, n)  # warm-up of the no-op path
    for _ in range(spec["runs"]):  # interleaved, so both see the same machine conditions
        for fns, nk, acc in ((originals, False, real), (noops, True, noop)):
            use(fns, nk)
            s = olv_runtime.GenerationStats()
            olv_runtime.generate(sess, prompt, n, stats=s)
            acc.append(s.decode_seconds / max(n - 1, 1))
    use(originals, False)
    return {"real_s_per_token": _median(real), "noop_s_per_token": _median(noop),
            "steps": len(sess._steps), "kinds": sorted({s.kind for s in sess._steps}),
            "compiled_stack": bool(stacks)}


def phase_paged(spec):
    """Decode tok/s after a ``context``-token prompt for one KV kind (contiguous or paged)."""
    import olv_runtime
    from olv_runtime.state import empty_cache, make_state

    sess = _olv_session(spec, spec["quantize"])
    out = {}
    n = spec["paged_new_tokens"]
    for ctx in spec["contexts"]:
        ids = prompt_ids(ctx, spec["vocab"], ctx + 7)
        tts = []
        for _ in range(spec["paged_runs"]):
            st = make_state(sess, empty_cache(sess))
            lg = st.run({"input_ids": ids.reshape(1, -1)})["logits"]
            tok = int(np.argmax(lg[0, -1]))
            stamps = [time.perf_counter()]
            for _ in range(n):
                lg = st.run({"input_ids": np.array([[tok]], np.int64)})["logits"]
                tok = int(np.argmax(lg[0, -1]))
                sess.recycle(lg)
                stamps.append(time.perf_counter())
            st.close()
            tts += [b - a for a, b in zip(stamps, stamps[1:])]
        out[str(ctx)] = 1.0 / _median(tts)
    return {"decode_tps_by_context": out, "kv": spec["kv"], "plan_steps": len(sess._steps),
            "compiled_stack": any(s.kind == "DecoderStack" for s in sess._steps)}


def _measured_runs(spec, generate, prompt, n):
    """``runs`` generate calls of ``n`` tokens (``generate(ids, n, stats)`` records
    ``stats["prefill"]``, ``stats["decode"]`` seconds and ``stats["stamps"]``, one
    ``perf_counter`` per token) and the prefill lengths; returns (prefill tok/s per run, decode
    tok/s per run, per-token decode times, {length: prefill tok/s})."""
    pf, dec, tt = [], [], []
    for _ in range(spec["runs"]):
        s = {}
        generate(prompt, n, s)
        pf.append(len(prompt) / s["prefill"])
        dec.append((n - 1) / s["decode"])
        st = s["stamps"]
        tt += [b - a for a, b in zip(st, st[1:])]

    def one(ids):
        s = {}
        generate(ids, 1, s)
        return s["prefill"]
    return pf, dec, tt, _measure_prefills(spec, one)


def phase_ort(spec):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = spec["threads"]
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    t0 = time.perf_counter()
    sess = ort.InferenceSession(spec["ort_model"], so, providers=["CPUExecutionProvider"])
    t_session = time.perf_counter() - t0
    L, KVH, D = spec["layers"], spec["kv_heads"], spec["head_dim"]
    out_names = [o.name for o in sess.get_outputs()]
    empty = np.zeros((1, KVH, 0, D), np.float32)

    def generate(ids, n_new, stats):
        """Prefill + n_new - 1 decode calls with IOBinding; presents fed back as OrtValues."""
        stamps = stats.setdefault("stamps", [])
        io = sess.io_binding()
        past = {f"past_{k}.{i}": ort.OrtValue.ortvalue_from_numpy(empty)
                for i in range(L) for k in ("key", "value")}
        total = len(ids)
        cur = ids.reshape(1, -1)
        out = []
        t0 = time.perf_counter()
        for step in range(n_new):
            io.clear_binding_inputs()
            io.clear_binding_outputs()
            io.bind_cpu_input("input_ids", np.ascontiguousarray(cur, np.int64))
            io.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
            io.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
            for name, v in past.items():
                io.bind_ortvalue_input(name, v)
            for name in out_names:
                io.bind_output(name, "cpu")
            sess.run_with_iobinding(io)
            res = io.get_outputs()
            logits = res[0].numpy()
            tok = int(np.argmax(logits[0, -1]))
            out.append(tok)
            stamps.append(time.perf_counter())
            if step == 0:
                stats["prefill"] = time.perf_counter() - t0
                stats["logits"] = logits
                t1 = time.perf_counter()
            for name, v in zip(out_names[1:], res[1:]):
                past[name.replace("present_", "past_")] = v
            cur = np.array([[tok]], np.int64)
            total += 1
        stats["decode"] = time.perf_counter() - t1
        return out

    prompt = prompt_ids(spec["prompt_len"], spec["vocab"], 0)
    n = spec["new_tokens"]
    s = {}
    generate(prompt, n, s)  # warm-up
    ref = np.load(spec["ref_logits"]) if spec.get("ref_logits") else None
    diff = float(np.abs(s["logits"] - ref).max()) if ref is not None else float("nan")
    top1 = float((s["logits"].argmax(-1) == ref.argmax(-1)).mean()) if ref is not None else float("nan")
    pf, dec, tt, pf_by = _measured_runs(spec, generate, prompt, n)
    return {"prefill_tps": _median(pf), "prefill_by_len": pf_by,
            "decode_tps": 1.0 / _median(tt), "decode_runs": dec, "rss": peak_rss(),
            "weight_bytes": spec["weight_bytes"], "session_seconds": t_session,
            "max_abs_diff": diff, "top1_agree": top1,
            "ort_version": ort.__version__}


def phase_torch(spec):
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"],
                                                              dtype=torch.float32).eval()
    t_session = time.perf_counter() - t0
    cfg = model.config
    seen, wbytes = set(), 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            wbytes += mod.weight.numel() * mod.weight.element_size()

    def generate(ids, n_new, stats):
        with torch.inference_mode():
            t0 = time.perf_counter()
            o = model(input_ids=torch.from_numpy(ids.reshape(1, -1)), use_cache=True)
            tok = int(o.logits[0, -1].argmax())
            stats["prefill"] = time.perf_counter() - t0
            past = o.past_key_values
            out = [tok]
            t1 = time.perf_counter()
            stamps = stats.setdefault("stamps", [t1])
            for _ in range(n_new - 1):
                o = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = o.past_key_values
                tok = int(o.logits[0, -1].argmax())
                out.append(tok)
                stamps.append(time.perf_counter())
            stats["decode"] = time.perf_counter() - t1
        return out

    prompt = prompt_ids(spec["prompt_len"], cfg.vocab_size, 0)
    n = spec["new_tokens"]
    generate(prompt, 4, {})
    pf, dec, tt, pf_by = _measured_runs(spec, generate, prompt, n)
    return {"prefill_tps": _median(pf), "prefill_by_len": pf_by,
            "decode_tps": 1.0 / _median(tt), "decode_runs": dec, "rss": peak_rss(),
            "weight_bytes": wbytes, "session_seconds": t_session,
            "torch_version": torch.__version__, "torch_threads": torch.get_num_threads()}


def phase_llama(spec):
    import llama_cpp

    t0 = time.perf_counter()
    longest = max(_prefill_lens(spec) + [spec["prompt_len"] + spec["new_tokens"]])
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=longest + 16,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_batch=max(512, longest), n_ubatch=max(512, longest),
                          logits_all=False, verbose=False)
    t_session = time.perf_counter() - t0
    nv = llm.n_vocab()

    def last_logits():
        # llama-cpp-python 0.3.36 keeps llm.scores only with logits_all: read the context's row
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))

    def generate(ids, n_new, stats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval([int(i) for i in ids])
        tok = int(np.argmax(last_logits()))
        stats["last_logits"] = last_logits().copy()
        stats["prefill"] = time.perf_counter() - t0
        out = [tok]
        t1 = time.perf_counter()
        stamps = stats.setdefault("stamps", [t1])
        for _ in range(n_new - 1):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
            out.append(tok)
            stamps.append(time.perf_counter())
        stats["decode"] = time.perf_counter() - t1
        return out

    prompt = prompt_ids(spec["prompt_len"], spec["vocab"], 0)
    n = spec["new_tokens"]
    s = {}
    generate(prompt, n, s)
    ref = np.load(spec["ref_logits"]) if spec.get("ref_logits") else None
    diff = top1 = float("nan")
    if ref is not None:  # last prompt position only (logits_all would slow llama.cpp down)
        diff = float(np.abs(s["last_logits"] - ref[0, -1]).max())
        top1 = float(s["last_logits"].argmax() == ref[0, -1].argmax())
    pf, dec, tt, pf_by = _measured_runs(spec, generate, prompt, n)
    return {"prefill_tps": _median(pf), "prefill_by_len": pf_by,
            "decode_tps": 1.0 / _median(tt), "decode_runs": dec, "rss": peak_rss(),
            "weight_bytes": spec["weight_bytes"], "session_seconds": t_session,
            "max_abs_diff_last": diff, "top1_last": top1,
            "llama_cpp_version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}


def phase_genai(spec):
    """onnxruntime-genai on the INT4 model its own builder wrote for the checkpoint."""
    import onnxruntime_genai as og

    t0 = time.perf_counter()
    cfg = og.Config(spec["genai_dir"])
    model = og.Model(cfg)
    t_session = time.perf_counter() - t0
    longest = max(_prefill_lens(spec) + [spec["prompt_len"] + spec["new_tokens"]])

    def generate(ids, n_new, stats):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n_new + 1, do_sample=False,
                                  min_length=len(ids) + n_new + 1)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens([int(i) for i in ids])
        gen.generate_next_token()
        out = [int(gen.get_next_tokens()[0])]
        stats["prefill"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        stamps = stats.setdefault("stamps", [t1])
        for _ in range(n_new - 1):
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        stats["decode"] = time.perf_counter() - t1
        return out

    assert longest > 0
    prompt = prompt_ids(spec["prompt_len"], spec["vocab"], 0)
    n = spec["new_tokens"]
    generate(prompt, n, {})
    pf, dec, tt, pf_by = _measured_runs(spec, generate, prompt, n)
    return {"prefill_tps": _median(pf), "prefill_by_len": pf_by,
            "decode_tps": 1.0 / _median(tt), "decode_runs": dec, "rss": peak_rss(),
            "weight_bytes": spec["weight_bytes"], "session_seconds": t_session,
            "genai_version": og.__version__}


PHASES = {"bandwidth": phase_bandwidth, "olv": phase_olv, "ttft": phase_ttft,
          "overhead": phase_overhead, "ort": phase_ort, "torch": phase_torch, "llama": phase_llama,
          "genai": phase_genai, "paged": phase_paged}


# ================================================================================================
# orchestration (parent process)
# ================================================================================================
def _cpu_jiffies():
    """(busy, steal) jiffies of all CPUs from /proc/stat (None where unavailable)."""
    try:
        f = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_idle(max_wait: float, threshold: float = 0.15) -> tuple[float, float]:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` of all cores over a
    1 s sample; returns (seconds waited, last load sample)."""
    t0 = time.time()
    load = float("nan")
    while True:
        j0 = _cpu_jiffies()
        if j0 is None:
            return 0.0, load
        time.sleep(1.0)
        j1 = _cpu_jiffies()
        load = (j1[0] - j0[0]) / os.sysconf("SC_CLK_TCK") / (os.cpu_count() or 1)
        if load < threshold or time.time() - t0 >= max_wait:
            return time.time() - t0, load


WAIT_IDLE = 0.0


RETRY_BUSY = 0
BUSY = 0.10


def run_phase(name, spec, env=None, timeout=1800):
    """Run a phase; re-run it (up to RETRY_BUSY times) while other processes used more than
    BUSY of the cores during it, keeping the result measured under the least foreign load."""
    best = _run_phase_once(name, spec, env, timeout)
    for _ in range(RETRY_BUSY):
        if "error" in best or best.get("foreign_load", 0.0) <= BUSY or name == "ttft":
            break
        log(f"  ({name}: {100 * best['foreign_load']:.0f} % other load during the phase; re-running)")
        again = _run_phase_once(name, spec, env, timeout)
        if "error" not in again and again.get("foreign_load", 1.0) < best["foreign_load"]:
            again["retried"] = True
            best = again
    return best


def _run_phase_once(name, spec, env=None, timeout=1800):
    """Run one phase in a fresh interpreter; returns its result dict (or {'error': ...}).

    Also measures the CPU time other processes used while the phase ran ("foreign load", % of
    all cores; busy jiffies of /proc/stat minus this phase's own CPU time) and the hypervisor
    steal: benchmark figures taken while either is high are not trustworthy."""
    waited, idle_load = wait_idle(WAIT_IDLE) if WAIT_IDLE > 0 else (0.0, float("nan"))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    j0, c0 = _cpu_jiffies(), _children_cpu()
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--phase", name,
           "--phase-spec", json.dumps(spec), "--phase-out", out_path]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "launched": t0}
    try:
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "launched": t0}
        res = json.loads(pathlib.Path(out_path).read_text())
        res["launched"] = t0
        res["wall"] = wall = time.time() - t0
        res["waited_idle"], res["load_before"] = waited, idle_load
        j1, c1 = _cpu_jiffies(), _children_cpu()
        if j0 and j1:
            hz = os.sysconf("SC_CLK_TCK")
            cap = wall * (os.cpu_count() or 1)
            res["foreign_load"] = max(0.0, ((j1[0] - j0[0]) / hz - (c1 - c0)) / cap)
            res["steal"] = (j1[1] - j0[1]) / hz / cap
        return res
    finally:
        pathlib.Path(out_path).unlink(missing_ok=True)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _checkpoint_dtype(ckpt) -> str:
    """The stored dtype of a Hugging Face checkpoint ("bf16", "fp32", ...), from its
    safetensors header (config.json's torch_dtype can disagree with the file)."""
    from olv_runtime.models.checkpoint import Checkpoint

    names = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
    try:
        with Checkpoint(ckpt) as c:
            kinds = sorted({names.get(c.dtype(n), c.dtype(n)) for n in c.keys()})
    except Exception:  # noqa: BLE001 - a label only
        return "original"
    return "/".join(kinds) or "original"


def _fresh(target: pathlib.Path, source: pathlib.Path) -> bool:
    return target.is_file() and target.stat().st_mtime >= source.stat().st_mtime


def prepare(args):
    """Checkpoint, olv model, ORT models (cached); returns paths and model facts."""
    cache = pathlib.Path(args.cache_dir).expanduser()
    ckpt = pathlib.Path(args.checkpoint) if args.checkpoint else None
    if args.model:
        model = pathlib.Path(args.model)
    else:
        if ckpt is None:
            ckpt = cache / "q05b"
            if not (ckpt / "config.json").is_file():
                log(f"building the random Qwen2.5-0.5B-shaped checkpoint in {ckpt}")
                subprocess.run([sys.executable, str(HERE / "make_checkpoint.py"), str(ckpt)], check=True)
        model = cache / f"{ckpt.resolve().name}_int4" / "model.onnx"
        src = max(ckpt.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        if not _fresh(model, src):
            log(f"converting {ckpt} -> {model} (int4-block32)")
            model.parent.mkdir(parents=True, exist_ok=True)
            import olv_runtime

            olv_runtime.convert(ckpt, model, weights="int4-block32")
    import olv_runtime

    md = olv_runtime.load(model).metadata()
    facts = dict(layers=int(md["olv.num_layers"]), kv_heads=int(md["olv.num_kv_heads"]),
                 head_dim=int(md["olv.head_dim"]), vocab=int(md["olv.vocab_size"]))
    ort_models = {}
    if "ort" in args.backends:
        sys.path.insert(0, str(HERE))
        import ort_export

        import hashlib

        tag = hashlib.sha1(str(model.resolve()).encode()).hexdigest()[:10]
        for level in args.ort_levels:
            out = cache / "ort" / f"{tag}_acc{level}.onnx"
            if not _fresh(out, model):
                log(f"exporting the onnxruntime MatMulNBits graph (accuracy_level {level}) -> {out}")
                ort_export.export(model, out, accuracy_level=level, progress=log)
            ort_models[level] = out
        facts["ort_weight_bytes"] = ort_export.weight_bytes_per_token(model)
    return ckpt, model, ort_models, facts


def _llama_version() -> str:
    from importlib.metadata import version

    return version("llama_cpp_python")


def prepare_genai(args, ckpt):
    """The onnxruntime-genai builder's INT4 CPU model of ``ckpt`` (cached), its
    ``intra_op_num_threads`` set to ``--threads``; returns (dir, MatMulNBits weight bytes)."""
    cache = pathlib.Path(args.cache_dir).expanduser() / "genai"
    out = cache / f"{ckpt.resolve().name}_int4"
    src = max(ckpt.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    if not _fresh(out / "model.onnx", src):
        log(f"building the onnxruntime-genai int4 model -> {out}")
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt),
                        "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(cache / "hf_cache")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg_path = out / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    if so.get("intra_op_num_threads") != args.threads:
        so["intra_op_num_threads"] = args.threads
        so["inter_op_num_threads"] = 1
        cfg_path.write_text(json.dumps(cfg, indent=4))
    import onnx

    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    nbytes = 0
    for t in m.graph.initializer:
        if t.name.endswith(("_Q4", "_scales", "_zero_points")):
            nbytes += int(np.prod(t.dims)) * (4 if t.data_type == onnx.TensorProto.FLOAT else
                                              2 if t.data_type == onnx.TensorProto.FLOAT16 else 1)
    return out, nbytes


def prepare_compiled(args, model: pathlib.Path) -> pathlib.Path:
    """The seed 004 compiled copy of ``model`` in the bench cache (``olv compile``, run once;
    again when the model is newer or the copy has no entries for this CPU's device descriptor)."""
    import hashlib

    import olv_runtime
    from olv_runtime.structs.compiled import this_device

    tag = hashlib.sha1(str(model.resolve()).encode()).hexdigest()[:10]
    out = pathlib.Path(args.cache_dir).expanduser() / "compiled" / tag / "model.onnx"
    here = this_device()
    want = (here.type, here.architecture, here.runtime, here.runtime_version)
    if not (_fresh(out, model) and any(
            (d.type, d.architecture, d.runtime, d.runtime_version) == want
            for d in olv_runtime.load(out).proto.devices)):
        log(f"olv compile {model} -> {out}")
        rep = olv_runtime.compile_model(model, out)
        log(f"  {rep.entries} compiled entries, {rep.bytes / 1e6:.1f} MB")
    return out


def genai_olv_rows(args, base, gdir, tmp, add_row):
    """olv_runtime on the onnxruntime-genai builder's own files (``gdir/model.onnx``, adapted
    from genai_config.json at load): exact and int8-activation rows, the same file and threads
    as the onnxruntime-genai row (issue 12). Returns {mode: decode tok/s}."""
    res = {}
    for quant in (False, True):
        if ("olv" if not quant else "olv-q") not in args.backends:
            continue
        mode = "int8 act." if quant else "exact"
        log(f"[olv_runtime {mode} on the onnxruntime-genai model]")
        r = run_phase("olv", dict(base, model=str(gdir / "model.onnx"), quantize=quant,
                                  logits_out=str(tmp / f"genai_olv_{int(quant)}.npy")))
        add_row(f"olv_runtime {mode} on the onnxruntime-genai int4 file", r,
                f"olv generate {gdir / 'model.onnx'} (MatMulNBits on the packed INT4 kernels)")
        res[mode] = r.get("decode_tps")
    return res


def gguf_rows(args, base, ckpt, model, tmp, add_row):
    """GGUF rows (bench/gguf_bench.py): the ``--gguf`` files and the ``--gguf-types`` files made
    from F16 GGUFs of the ``--gguf-shapes`` checkpoints by llama.cpp's quantizer; each converted
    by ``olv convert`` (payloads stay in the .gguf) and run by olv exact / int8 activations, by
    llama.cpp (llama-cpp-python) and, with ``--ik-bench``, by ik_llama.cpp's ``llama-bench`` on the
    same file, same threads. Returns ``[{"file", "types", "weight_bytes", "olv", "olv_q",
    "llama", "ik", "<backend>_row": phase result, "ratio", "ratio_q"}]`` (decode tok/s; ratios to
    llama.cpp)."""
    import olv_runtime

    sys.path.insert(0, str(HERE))
    import gguf_bench
    from olv_runtime.models.gguf_reader import GGUFFile

    cache = pathlib.Path(args.cache_dir).expanduser()
    files = [pathlib.Path(p).expanduser() for p in args.gguf.split(",") if p.strip()]
    types = [t.strip().lower() for t in args.gguf_types.split(",") if t.strip()]
    if args.gguf_q4km and "q4_k_m" not in types:
        types.append("q4_k_m")
    shapes = [s.strip() for s in args.gguf_shapes.split(",") if s.strip()]
    if types:
        files += gguf_bench.make_files(shapes, types, cache, args.threads, log)
    ik = gguf_bench.ik_binary(args.ik_bench)
    out = []
    for f in files:
        target = cache / "gguf_olv" / f.stem / "model.onnx"
        if not _fresh(target, f):
            log(f"[gguf] olv convert {f} -> {target}")
            olv_runtime.convert(f, target)
        with GGUFFile(f) as g:
            types_f = sorted({t.type_name for t in g.tensors.values()})
            wbytes = sum(t.nbytes for t in g.tensors.values() if len(t.shape) == 2)
            layer_macs = sum(int(np.prod(t.shape)) for name, t in g.tensors.items()
                             if name.startswith("blk.") and len(t.shape) == 2)
            arch = g.get("general.architecture")
            heads, embd = g.get(f"{arch}.attention.head_count"), g.get(f"{arch}.embedding_length")
            shape = dict(layers=int(g.get(f"{arch}.block_count")),
                         kv_heads=int(g.get(f"{arch}.attention.head_count_kv")),
                         head_dim=int(g.get(f"{arch}.attention.key_length") or embd // heads))
        tag = f"{f.name} ({'/'.join(types_f)})"
        logits = tmp / f"gguf_{f.stem}_logits.npy"
        res = {"file": str(f), "types": types_f, "weight_bytes": wbytes,
               "layer_macs": layer_macs}
        spec = dict(base, model=str(target), **shape)  # the file's own KV shape
        for key, quant in (("olv", False), ("olv_q", True)):
            name = "olv" if not quant else "olv-q"
            if name not in args.backends and f"gguf-{name}" not in args.backends:
                continue
            log(f"[gguf olv_runtime {'int8 act.' if quant else 'exact'}] {tag}")
            r = run_phase("olv", dict(spec, quantize=quant,
                                      logits_out=str(tmp / f"gguf_{f.stem}_{key}.npy")
                                      if quant else str(logits)))
            add_row(f"olv_runtime {'int8 act.' if quant else 'exact'} on GGUF {tag}", r)
            res[key], res[key + "_row"] = r.get("decode_tps"), r
        if "llama" in args.backends or "gguf-llama" in args.backends:
            log(f"[gguf llama.cpp] {tag}")
            r = run_phase("llama", dict(spec, gguf=str(f), weight_bytes=wbytes,
                                        ref_logits=str(logits) if logits.is_file() else None))
            add_row(f"llama.cpp on GGUF {tag}", r)
            res["llama"], res["llama_row"] = r.get("decode_tps"), r
        if ik is not None:
            log(f"[gguf ik_llama.cpp llama-bench -rtr 1] {tag}")
            r = gguf_bench.ik_row(ik, f, args.threads, args.prefill_lens, args.new_tokens,
                                  args.runs)
            log(f"  {r.get('error') or r['cmd']}")
            res["ik"], res["ik_row"] = r.get("decode_tps"), r
        for key in ("olv", "olv_q"):
            if res.get(key) and res.get("llama"):
                res["ratio" + key[3:]] = res[key] / res["llama"]
        log(f"[gguf] {tag}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()
                                          if isinstance(v, float)))
        out.append(res)
    return out


def fmt(v, spec="{:.1f}"):
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    return spec.format(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="Hugging Face checkpoint dir (default: built in the cache)")
    ap.add_argument("--model", help="olv INT4 model (default: converted from the checkpoint)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="measured runs per backend (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-lens", default="128,512",
                    help="separate prefill measurements (prompt lengths, comma-separated)")
    ap.add_argument("--cache-dir", default=os.environ.get("OLV_BENCH_CACHE", "~/.cache/olv_bench"))
    ap.add_argument("--backends", default="olv,olv-q,olv-c,ort,genai,torch,llama",
                    help="comma-separated subset of olv,olv-q,olv-c,olv-qc,ort,genai,torch,llama "
                         "(olv-c / olv-qc: olv on the seed 004 compiled copy)")
    ap.add_argument("--ort-levels", default="4,0", help="MatMulNBits accuracy levels to run")
    ap.add_argument("--no-ttft", action="store_true", help="skip the cold/warm start measurement")
    ap.add_argument("--no-overhead", action="store_true", help="skip the executor-overhead phase")
    ap.add_argument("--paged", default="paged-int8,paged-mixed",
                    help="paged KV kinds compared with contiguous at --contexts ('' to skip)")
    ap.add_argument("--contexts", default="1024,4096", help="contexts of the paged comparison")
    ap.add_argument("--paged-runs", type=int, default=2,
                    help="prompt + 32-token decode runs per context in the paged comparison")
    ap.add_argument("--wait-idle", type=float, default=30.0,
                    help="before each phase, wait up to this many seconds for other processes to "
                         "use < 15%% of the cores (0: don't wait)")
    ap.add_argument("--retry-busy", type=int, default=1,
                    help="re-run a phase up to N times if other processes used > 10%% of the "
                         "cores during it (default 1)")
    ap.add_argument("--gguf", default="",
                    help="comma-separated GGUF files of the same checkpoint shape: each is "
                         "converted with olv convert (tensors read in place) and run by olv "
                         "(exact, int8 act.) and llama.cpp on the same file (GGUF rows; "
                         "--backends gguf-olv,gguf-olv-q,gguf-llama runs only these)")
    ap.add_argument("--gguf-types", default="",
                    help="comma-separated llama.cpp file types (q4_k_m, q8_0, q6_k, q5_k_m, "
                         "q4_0, ...) made from an F16 GGUF of each --gguf-shapes checkpoint by "
                         "llama.cpp's own quantizer (llama_cpp.llama_model_quantize), then run "
                         "as --gguf files")
    ap.add_argument("--gguf-shapes", default="qwen2.5-0.5b",
                    help="random checkpoints for --gguf-types: qwen2.5-0.5b, qwen3-0.6b "
                         "(bench/make_checkpoint.py; built in <cache-dir>/checkpoints)")
    ap.add_argument("--gguf-q4km", action="store_true",
                    help="same as --gguf-types q4_k_m (kept for earlier commands)")
    ap.add_argument("--ik-bench", default=None,
                    help="ik_llama.cpp's llama-bench (default $OLV_IK_BENCH): adds its rows "
                         "(-rtr 1, same threads, prefill lengths and new tokens) to every GGUF "
                         "file")
    ap.add_argument("--no-genai-olv", action="store_true",
                    help="skip olv_runtime's rows on the onnxruntime-genai builder's file")
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--phase-spec", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        res = PHASES[args.phase](json.loads(args.phase_spec))
        pathlib.Path(args.phase_out).write_text(json.dumps(res))
        return 0

    global WAIT_IDLE, RETRY_BUSY
    WAIT_IDLE = args.wait_idle
    RETRY_BUSY = args.retry_busy
    t_all = time.perf_counter()
    args.backends = set(b.strip() for b in args.backends.split(",") if b.strip())
    args.ort_levels = [int(x) for x in args.ort_levels.split(",") if x.strip()]
    args.prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x.strip()]
    ckpt, model, ort_models, facts = prepare(args)
    base = dict(model=str(model), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                runs=args.runs, threads=args.threads, prefill_lens=args.prefill_lens, **facts)
    kvb = kv_bytes_per_token(base)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="olv-bench-"))
    ref_logits = tmp / "olv_exact_logits.npy"
    results = {"args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
               "model": str(model), "checkpoint": str(ckpt) if ckpt else None, "rows": []}

    log(f"[bandwidth] {args.threads}-thread streaming read over 1 GiB")
    bw = run_phase("bandwidth", base)
    results["bandwidth"] = bw
    if args.gguf or args.gguf_q4km or args.gguf_types:
        import fma_peak  # the exact-mode prefill ceiling (issue 25), measured before the rows

        log(f"[fma peak] {args.threads}-thread float32 FMA loop")
        results["fma_peak"] = fma_peak.measure(args.threads, 1.0, 5)
        log(f"  {results['fma_peak']['gflops_best']:.1f} GFLOP/s best")
    rows = results["rows"]

    def add_row(label, res, note=""):
        res = dict(res)
        res["label"], res["note"] = label, note
        rows.append(res)
        if "error" in res:
            log(f"  {label}: ERROR {res['error']}")
        else:
            log(f"  {label}: prefill {res['prefill_tps']:.1f} tok/s, prefill "
                + ", ".join(f"{k}: {v:.1f}" for k, v in res["prefill_by_len"].items())
                + f" tok/s, decode {res['decode_tps']:.1f} tok/s "
                f"(runs {', '.join(f'{x:.1f}' for x in res['decode_runs'])})")

    if "olv" in args.backends:
        log("[olv_runtime exact]")
        add_row("olv_runtime exact (fp32 activations)",
                run_phase("olv", dict(base, quantize=False, logits_out=str(ref_logits))))
    if "olv-q" in args.backends:
        log("[olv_runtime quantize_activations]")
        q_logits = tmp / "olv_quant_logits.npy"
        r = run_phase("olv", dict(base, quantize=True, logits_out=str(q_logits)))
        if "error" not in r and ref_logits.is_file():
            a, b = np.load(q_logits), np.load(ref_logits)
            r["max_abs_diff"] = float(np.abs(a - b).max())
            r["top1_agree"] = float((a.argmax(-1) == b.argmax(-1)).mean())
        add_row("olv_runtime quantize_activations (int8 act.)", r)
    compiled = prepare_compiled(args, model) if {"olv-c", "olv-qc"} & args.backends else None
    for quant, name in ((False, "olv-c"), (True, "olv-qc")):
        if name not in args.backends:
            continue
        mode = "quantize_activations (int8 act.)" if quant else "exact (fp32 activations)"
        log(f"[olv_runtime {mode}, seed 004 compiled entries]")
        c_logits = tmp / f"olv_compiled_{int(quant)}_logits.npy"
        if not quant and not ref_logits.is_file():
            c_logits = ref_logits  # the reference of the other backends' logits checks
        r = run_phase("olv", dict(base, model=str(compiled), quantize=quant,
                                  logits_out=str(c_logits)))
        if "error" not in r and ref_logits.is_file() and c_logits != ref_logits:
            a, b = np.load(c_logits), np.load(ref_logits)
            r["max_abs_diff"] = float(np.abs(a - b).max())
            r["top1_agree"] = float((a.argmax(-1) == b.argmax(-1)).mean())
        add_row(f"olv_runtime {mode}, compiled entries", r,
                f"olv compile {model} {compiled}: {r.get('compiled_hits')} hits, "
                f"{r.get('compiled_misses')} misses, load + session creation "
                f"{r.get('session_seconds', float('nan')):.3f} s")
    if "ort" in args.backends:
        import onnxruntime

        sys.path.insert(0, str(HERE))
        from ort_export import contract

        for level, path in ort_models.items():
            log(f"[onnxruntime accuracy_level {level}]")
            r = run_phase("ort", dict(base, ort_model=str(path), weight_bytes=facts["ort_weight_bytes"],
                                      ref_logits=str(ref_logits) if ref_logits.is_file() else None))
            add_row(f"onnxruntime {onnxruntime.__version__} acc{level}"
                    f" ({'int8' if level == 4 else 'fp32'} act.)", r, contract(level))
    if "genai" in args.backends:
        if ckpt is None:
            log("[onnxruntime-genai] skipped: no --checkpoint")
        else:
            log("[onnxruntime-genai builder model]")
            try:
                gdir, gbytes = prepare_genai(args, ckpt)
                import onnxruntime_genai

                add_row(f"onnxruntime-genai {onnxruntime_genai.__version__} (own builder, int4)",
                        run_phase("genai", dict(base, genai_dir=str(gdir), weight_bytes=gbytes)),
                        f"python -m onnxruntime_genai.models.builder -i {ckpt} -o {gdir} "
                        "-p int4 -e cpu (its own quantization of the checkpoint)")
                if not args.no_genai_olv:
                    genai_olv_rows(args, base, gdir, tmp, add_row)
            except Exception as exc:  # noqa: BLE001
                log(f"onnxruntime-genai: failed ({type(exc).__name__}: {exc})")
    if "torch" in args.backends:
        if ckpt is None:
            log("[transformers] skipped: no --checkpoint")
        else:
            log("[transformers fp32]")
            add_row("transformers fp32 (torch)", run_phase("torch", dict(base, checkpoint=str(ckpt))),
                    f"fp32 weights from the {_checkpoint_dtype(ckpt)} checkpoint (not INT4)")
    llama_note = None
    if "llama" in args.backends:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            llama_note = "llama.cpp: skipped (llama_cpp / llama-cpp-python is not importable)"
        else:
            sys.path.insert(0, str(HERE))
            try:
                import gguf_export

                import hashlib

                tag = hashlib.sha1(str(model.resolve()).encode()).hexdigest()[:10]
                gguf_path = pathlib.Path(args.cache_dir).expanduser() / "gguf" / f"{tag}-q4_0.gguf"
                if not _fresh(gguf_path, model):
                    gguf_export.export(model, gguf_path, progress=log)
                log("[llama.cpp Q4_0]")
                add_row(f"llama.cpp Q4_0 (llama-cpp-python {_llama_version()})", run_phase("llama", dict(
                    base, gguf=str(gguf_path), weight_bytes=gguf_export.q4_0_weight_bytes(model),
                    ref_logits=str(ref_logits) if ref_logits.is_file() else None)),
                    "Q4_0 GGUF holding the olv INT4 codes and float16 scales (the same weights "
                    "as olv when the model stores float16 scales, the converter default)")
            except Exception as exc:  # noqa: BLE001
                llama_note = f"llama.cpp: failed ({type(exc).__name__}: {exc})"
        if llama_note:
            log(llama_note)

    gguf_pairs = gguf_rows(args, base, ckpt, model, tmp, add_row) \
        if (args.gguf or args.gguf_q4km or args.gguf_types) else []
    results["gguf"] = gguf_pairs

    ttft = None
    ttft_cache = None
    if not args.no_ttft:
        log("[time to first token: fresh interpreter, empty NUMBA_CACHE_DIR, then again]")
        ttft_cache = tempfile.mkdtemp(prefix="olv-numba-cache-")
        env = dict(os.environ, NUMBA_CACHE_DIR=ttft_cache)
        ttft = []
        for _ in range(2):
            r = run_phase("ttft", dict(base, quantize=False), env=env)
            if "error" not in r:
                r["ttft"] = r["t_first"] - r["launched"]
            ttft.append(r)
        results["ttft"] = ttft
    paged_rows = []
    kinds = [k.strip() for k in args.paged.split(",") if k.strip()]
    if kinds and ckpt is not None:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        for kind in ["contiguous"] + kinds:
            path = model
            if kind != "contiguous":
                path = pathlib.Path(args.cache_dir).expanduser() / f"{ckpt.resolve().name}_{kind}" / "model.onnx"
                src = max(ckpt.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
                if not _fresh(path, src):
                    log(f"converting {ckpt} -> {path} (int4-block32, --kv {kind})")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    import olv_runtime

                    olv_runtime.convert(ckpt, path, weights="int4-block32", kv=kind)
            log(f"[paged comparison: {kind}, contexts {contexts}]")
            r = run_phase("paged", dict(base, model=str(path), kv=kind, quantize=True,
                                        contexts=contexts, paged_new_tokens=32,
                                        paged_runs=args.paged_runs))
            r["kind"] = kind
            paged_rows.append(r)
            if "error" in r:
                log(f"  {kind}: ERROR {r['error']}")
            else:
                log(f"  {kind}: " + ", ".join(f"ctx {c}: {v:.1f} tok/s"
                                              for c, v in r["decode_tps_by_context"].items()))
        results["paged"] = paged_rows
        ik = None
        if kinds:
            sys.path.insert(0, str(HERE))
            import gguf_bench

            ik = gguf_bench.ik_binary(args.ik_bench)
        if ik is not None:  # ik_llama.cpp on the same INT4 codes (Q4_0), 8-bit and f16 caches
            import gguf_export

            q4 = pathlib.Path(args.cache_dir).expanduser() / "gguf" / f"{model.parent.name}-q4_0.gguf"
            if not _fresh(q4, model):
                gguf_export.export(model, q4, progress=log)
            for ct in ("q8_0", "f16"):
                log(f"[paged comparison: ik_llama.cpp -fa 1 -ctk {ct} -ctv {ct}, contexts {contexts}]")
                r = gguf_bench.ik_long(ik, q4, args.threads, contexts, 32, args.paged_runs, ct)
                r["kind"] = f"ik_llama.cpp {ct} KV (-rtr 1 -fa 1)"
                paged_rows.append(r)
                log(f"  {r.get('error') or r['decode_tps_by_context']}")
    overhead = None
    if not args.no_overhead:
        log("[executor overhead: kernels replaced by no-ops]")
        overhead = run_phase("overhead", dict(base, quantize=False))
        results["overhead"] = overhead

    # ------------------------------------------------------------------ report
    bw_best = bw.get("gbps_best", float("nan"))
    olv = next((r for r in rows if r["label"].startswith("olv_runtime exact") and "error" not in r), None)
    llama = next((r for r in rows if r["label"].startswith("llama.cpp") and "error" not in r), None)
    lens = [str(x) for x in args.prefill_lens]
    print()
    print(f"# decode benchmark: {model}")
    print(f"checkpoint {ckpt}; prompt {args.prompt_len} tokens (+ separate "
          f"{'/'.join(lens)}-token prefills), {args.new_tokens} new tokens, greedy; {args.threads} "
          f"threads; {args.runs} runs after a warm-up, decode tok/s = 1 / median per-token time; "
          f"each backend in its own subprocess")
    var = bw.get("variants", {})
    print(f"streaming read ({bw.get('threads', '?')} threads, fastest of the read kernels of "
          f"bench/_bandwidth.py over 1 GiB, best of 7): {fmt(bw_best)} GB/s (median "
          f"{fmt(bw.get('gbps_median'))} GB/s; variants: "
          + ", ".join(f"{k} {v[0]:.1f}" for k, v in var.items())
          + f" GB/s; vectorised loops: {bw.get('vectorised')})")
    print()
    hdr = (["backend", "decode tok/s", f"prefill tok/s ({args.prompt_len})"]
           + [f"prefill tok/s ({ln})" for ln in lens]
           + ["MB/token", "achieved GB/s", "% of bound", "bound tok/s", "peak RSS MB",
              "decode vs llama.cpp"] + [f"prefill({ln}) vs llama.cpp" for ln in lens]
           + ["other load"])
    table = []
    flags = []
    for r in rows:
        if "error" in r:
            table.append([r["label"], "error"] + [""] * (len(hdr) - 2))
            continue
        wb = r["weight_bytes"]
        bound = bw_best * 1e9 / wb
        achieved = (wb + kvb) * r["decode_tps"] / 1e9
        pct = 100 * achieved / bw_best
        mark = ""
        if above_bound(r["decode_tps"], bound):
            mark = " (!)"
            flags.append(f"(!) {r['label']}: decode {r['decode_tps']:.1f} tok/s is ABOVE the "
                         f"streaming-read bound {bound:.1f} tok/s: the bound or the byte count is "
                         "wrong for this row (e.g. weights smaller than counted, or cache-resident)")
        pf = r.get("prefill_by_len", {})
        table.append(
            [r["label"], fmt(r["decode_tps"]) + mark, fmt(r["prefill_tps"])]
            + [fmt(pf.get(ln)) for ln in lens]
            + [fmt(wb / 1e6, "{:.0f}"), fmt(achieved, "{:.2f}"), fmt(pct, "{:.0f} %") + mark,
               fmt(bound), fmt(r["rss"] / 1e6, "{:.0f}"),
               fmt(r["decode_tps"] / llama["decode_tps"], "{:.2f}x") if llama else "-"]
            + [fmt(pf.get(ln) / llama["prefill_by_len"][ln], "{:.2f}x")
               if llama and pf.get(ln) else "-" for ln in lens]
            + [fmt(100 * r.get("foreign_load", float("nan")), "{:.0f} %")])
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *table)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for t in table:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(t, widths)) + " |")
    print()
    for f in flags:
        print(f)
    if results.get("gguf"):
        sys.path.insert(0, str(HERE))
        import gguf_bench

        print()
        print(f"GGUF files, one run, {args.threads} threads (decode tok/s after a "
              f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens; ik_llama.cpp: "
              f"llama-bench -rtr 1, tg{args.new_tokens} from an empty context):")
        print()
        for line in gguf_bench.summary(results["gguf"], args.prefill_lens):
            print(line)
        print()
        for line in gguf_bench.exact_vs_peak(results["gguf"], args.prefill_lens,
                                             results.get("fma_peak")):
            print(line)
        print()
    for g in results.get("gguf", []):  # same GGUF file, same threads: the issue-13 ratios
        print(f"GGUF {g['file']} ({'/'.join(g['types'])}): decode olv exact "
              f"{fmt(g.get('olv'))} tok/s, olv int8 act. {fmt(g.get('olv_q'))}, llama.cpp "
              f"{fmt(g.get('llama'))} -> olv / llama.cpp = {fmt(g.get('ratio'), '{:.2f}x')} "
              f"(exact), {fmt(g.get('ratio_q'), '{:.2f}x')} (int8 act.)")
    print(f"MB/token = linear weight bytes each backend stores and streams per decode token; "
          f"achieved GB/s = (weight bytes + {kvb / 1e6:.1f} MB mean KV read) x decode tok/s; % of "
          f"bound = achieved / streaming read; bound tok/s = streaming read / weight bytes; other "
          f"load = CPU used by other processes during the phase, % of all cores (bandwidth phase: "
          f"{fmt(100 * bw.get('foreign_load', float('nan')), '{:.0f}')} %).")
    for r in rows:
        if "decode_runs" in r:
            print(f"  decode runs (mean rate per run) {r['label']}: "
                  + ", ".join(f"{x:.1f}" for x in r["decode_runs"]) + " tok/s")
    for r in rows:
        if "error" in r:
            print(f"{r['label']}: ERROR {r['error']}")
    for r in rows:
        if "max_abs_diff" in r:
            print(f"logits check vs olv exact, {args.prompt_len}-token prompt, all positions: "
                  f"{r['label']}: max |diff| {r['max_abs_diff']:.3g} (top-1 agreement "
                  f"{100 * r['top1_agree']:.0f} %)")
    for r in rows:
        if "max_abs_diff_last" in r:
            print(f"logits check vs olv exact, last prompt position: {r['label']}: max |diff| "
                  f"{r['max_abs_diff_last']:.3g} (same top-1: {bool(r['top1_last'])})")
    if olv and os.path.exists(ref_logits):  # absent when only GGUF backends ran
        print(f"olv exact logits: max |logit| {float(np.abs(np.load(ref_logits)).max()):.3g}")
    for r in rows:
        if r.get("note"):
            print(f"{r['label']}: {r['note']}")
    if llama:
        print(f"llama.cpp system info: {llama.get('system_info', '').strip()}")
    if llama_note:
        print(llama_note)
    ort_rows = [r for r in rows if r["label"].startswith("onnxruntime") and "error" not in r]
    olv_rows = [r for r in rows if r["label"].startswith("olv_runtime") and "error" not in r
                and "onnxruntime-genai" not in r["label"]]  # the same weights as llama.cpp
    if olv_rows:
        best = max(olv_rows, key=lambda r: r["decode_tps"])
        print()
        print("acceptance ratios (issue 10):")
        if llama:
            for r in olv_rows:
                exact = r["label"].startswith("olv_runtime exact")
                dt, pt = (0.85, 0.5) if exact else (1.0, 1.0)
                pf = r["prefill_by_len"]
                print(f"  {r['label']} / llama.cpp: decode "
                      f"{r['decode_tps'] / llama['decode_tps']:.2f}x (target >= {dt}), prefill "
                      + ", ".join(f"{ln}: {pf[ln] / llama['prefill_by_len'][ln]:.2f}x"
                                  for ln in lens if ln in pf and ln in llama["prefill_by_len"])
                      + f" (target >= {pt} at 128 and 512)")
        for o in ort_rows:
            print(f"  olv best ({best['label']}) / {o['label']}: decode "
                  f"{best['decode_tps'] / o['decode_tps']:.2f}x (target >= 1.5)")
    comp_rows = [r for r in olv_rows if r["label"].endswith("compiled entries")]
    if comp_rows:
        print("acceptance (issue 14, seed 004 compiled entries, same threads):")
        for r in comp_rows:
            plain = next((p for p in olv_rows if p["label"] == r["label"].replace(
                ", compiled entries", "")), None)
            print(f"  {r['label']}: peak RSS {r['rss'] / 1e6:.0f} MB"
                  + (f" = {r['rss'] / llama['rss']:.2f}x llama.cpp's {llama['rss'] / 1e6:.0f} MB"
                     " (target <= 1.0x)" if llama else "")
                  + (f"; decode {r['decode_tps'] / plain['decode_tps']:.2f}x the plain model's "
                     "(target: unchanged within noise)" if plain else "")
                  + f"; load + session creation {r['session_seconds']:.3f} s (bar: session creation <= 0.1 s); "
                  f"{r['compiled_hits']} hits, {r['compiled_misses']} misses")
    genai_row = next((r for r in ort_rows if "onnxruntime-genai" in r["label"]), None)
    same_file = [r for r in rows if r["label"].startswith("olv_runtime") and "error" not in r
                 and "onnxruntime-genai" in r["label"]]
    if genai_row and same_file:
        print("acceptance ratios (issue 12, the onnxruntime-genai builder's own file, same "
              "threads):")
        for r in same_file:
            print(f"  {r['label']} / {genai_row['label']}: decode "
                  f"{r['decode_tps'] / genai_row['decode_tps']:.2f}x (target >= 1.3 for the "
                  "best mode)")
    for r in olv_rows:
        al = r["decode_allocations"]
        print(f"{r['label']}: counters after warm-up: the {al['decode_steps']} decode steps of a "
              f"generate allocated {al['arrays']} arrays ({al['bytes'] / 1e6:.2f} MB): "
              f"{al['first_step_arrays']} in the first step, {al['later_steps_arrays']} "
              f"({al['later_steps_bytes'] / 1e6:.2f} MB) in steps 2..{al['decode_steps']} "
              f"= {al['later_steps_arrays'] / max(al['decode_steps'] - 1, 1):.2f} per token; "
              f"bytes dequantized {r['bytes_dequantized']}, plan {r['plan_steps']} steps, "
              f"session creation {r['session_seconds']:.1f} s, numba layer {r['threading_layer']}")
    if ttft:
        print()
        for i, r in enumerate(ttft):
            what = "first run (empty numba cache)" if i == 0 else "second run (warm numba cache)"
            if "error" in r:
                print(f"time to first token, {what}: ERROR {r['error']}")
            else:
                print(f"time to first token, {what}: {r['ttft']:.1f} s from process launch "
                      f"(import {r['import']:.1f} s, load + session {r['session']:.1f} s, "
                      f"prefill {args.prompt_len} + first token {r['first_generate']:.1f} s; other load "
                      f"{fmt(100 * r.get('foreign_load', float('nan')), '{:.0f}')} %)")
    if overhead:
        if "error" in overhead:
            print(f"executor overhead: ERROR {overhead['error']}")
        else:
            o, real = overhead["noop_s_per_token"], overhead["real_s_per_token"]
            main_row = (f", {100 * o * olv['decode_tps']:.1f} % of the olv exact row's "
                        f"{1e3 / olv['decode_tps']:.1f} ms/token") if olv else ""
            # the same Python runs in both modes: the int8 row (the faster one) is the bar
            q = next((r for r in rows if r["label"].startswith("olv_runtime quantize_activations")
                      and "error" not in r), None)
            if q:
                main_row += (f", {100 * o * q['decode_tps']:.1f} % of the olv int8 row's "
                             f"{1e3 / q['decode_tps']:.1f} ms/token")
            what = (" incl. the compiled DecoderStack's Python around its driver" if
                    overhead.get("compiled_stack") else "")
            if overhead.get("decode_program"):
                what = (", decode program: the compiled step's driver a no-op, the embedding "
                        "row and RoPE rows real")
            print(f"executor overhead (olv exact, {overhead['steps']} plan steps with no-op "
                  f"kernels{what}): "
                  f"{o * 1e3:.2f} ms/token = {100 * o / real:.1f} % of decode time "
                  f"({real * 1e3:.1f} ms/token, real kernels, interleaved runs in the same "
                  f"process{main_row}; other load "
                  f"{fmt(100 * overhead.get('foreign_load', float('nan')), '{:.0f}')} %)")
    if paged_rows:
        print()
        cont = next((r for r in paged_rows if r["kind"] == "contiguous" and "error" not in r),
                    None)
        print("paged KV vs contiguous (olv quantize_activations, decode tok/s after a prompt of "
              f"the context length, 32 new tokens, {args.paged_runs} run(s), 1 / median per-token time):")
        for r in paged_rows:
            if "error" in r:
                print(f"  {r['kind']}: ERROR {r['error']}")
                continue
            parts = []
            for c, v in r["decode_tps_by_context"].items():
                ratio = (f" = {v / cont['decode_tps_by_context'][c]:.2f}x contiguous"
                         if cont and r is not cont and v else "")
                parts.append(f"ctx {c}: {fmt(v)} tok/s{ratio}")
            tgt = {"paged-int8": " (target >= 1.0x)", "paged-mixed": " (target >= 0.9x)"}.get(
                r["kind"], "")
            if r["kind"].startswith("ik_llama.cpp"):
                print(f"  {r['kind']}: " + ", ".join(parts) + f" ({r['cmd']})")
                continue
            print(f"  {r['kind']}{tgt}: " + ", ".join(parts)
                  + f"; plan {r['plan_steps']} steps, compiled stack {r['compiled_stack']}; "
                  f"other load {fmt(100 * r.get('foreign_load', float('nan')), '{:.0f}')} %")
        by_kind = {r["kind"].split(" (")[0]: r for r in paged_rows if "error" not in r}
        for ours, theirs in (("paged-int8", "ik_llama.cpp q8_0 KV"),
                             ("paged-f16", "ik_llama.cpp f16 KV")):
            a, b = by_kind.get(ours), by_kind.get(theirs)
            if a and b:  # issue 25 item 4: >= 1.0x at every context
                print(f"  {ours} / {theirs}: " + ", ".join(
                    f"ctx {c}: " + (f"{v / b['decode_tps_by_context'][c]:.2f}x"
                                    if v and b["decode_tps_by_context"].get(c) else "-")
                    for c, v in a["decode_tps_by_context"].items()) + " (target >= 1.0x)")
    print(f"\ntotal benchmark wall time {time.perf_counter() - t_all:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)  # prompt logits
    if ttft_cache:
        shutil.rmtree(ttft_cache, ignore_errors=True)  # the cold-start numba cache
    return 0


if __name__ == "__main__":
    sys.exit(main())
