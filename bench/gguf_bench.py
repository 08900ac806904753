"""The GGUF part of bench/decode.py: the files people download, made here, and ik_llama.cpp's rows.

* :func:`make_files` -- per checkpoint shape (bench/make_checkpoint.py ``SHAPES``: a random
  Qwen2.5-0.5B- or Qwen3-0.6B-shaped checkpoint built locally), an F16 GGUF written with the
  ``gguf`` package (bench/gguf_export.py ``export_f16``), then each requested file type
  (``q4_k_m``, ``q8_0``, ``q6_k``, ... :data:`gguf_export.FILE_TYPES`) made from it by llama.cpp's
  own quantizer (``llama_cpp.llama_model_quantize``), which picks the per-tensor types exactly as
  ``llama-quantize`` does (Qwen2.5-0.5B's hidden size 896 is not a multiple of 256, so its
  "Q4_K_M" is mostly Q5_0 with Q4_K/Q6_K/Q8_0 tensors, as the published file is). Files are
  cached under ``<cache>/gguf`` and reused.
* :func:`ik_row` -- ik_llama.cpp's ``llama-bench`` on the same file and threads, with run-time
  repacking (``-rtr 1``, its fastest CPU layouts): ``pp<L>`` for every prefill length and
  ``tg<N>`` (decode from an empty context), ``-r`` repetitions, JSON output parsed; the peak RSS
  of the child from ``wait4``. The binary comes from ``--ik-bench`` or ``$OLV_IK_BENCH``; the
  rows are left out when neither is set (it is never built in CI).
* :func:`summary` -- one table per run: decode and prefill tok/s of olv (int8 activations and
  exact), llama.cpp and ik_llama.cpp on each file, with the issue-25 ratios (olv int8 / ik,
  olv exact / llama.cpp).

Decode figures differ slightly in context: olv and llama.cpp decode after a ``--prompt-len``
prompt, ``llama-bench``'s ``tg`` from an empty cache (a 32-token context changes a 0.5B model's
step by well under 1 %).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent


def make_files(shapes, types, cache: pathlib.Path, threads: int, log=print) -> list:
    """``[path]`` of the GGUF files of every (shape, file type), made when missing (see the
    module docstring). ``shapes``: keys of make_checkpoint.SHAPES; ``types``: keys of
    gguf_export.FILE_TYPES. Raises KeyError for an unknown shape or type before building
    anything."""
    sys.path.insert(0, str(HERE))
    import gguf_export
    import make_checkpoint

    for s in shapes:
        if s not in make_checkpoint.SHAPES:
            raise KeyError(f"--gguf-shapes: {s!r}: expected one of {sorted(make_checkpoint.SHAPES)}")
    for t in types:
        if t not in gguf_export.FILE_TYPES:
            raise KeyError(f"--gguf-types: {t!r}: expected one of {sorted(gguf_export.FILE_TYPES)}")
    out = []
    for shape in shapes:
        ckpt = cache / "checkpoints" / shape
        if not (ckpt / "config.json").is_file():
            log(f"[gguf] building the random {shape} checkpoint -> {ckpt}")
        make_checkpoint.build(ckpt, shape=shape)
        f16 = cache / "gguf" / f"{shape}-f16.gguf"
        for t in types:
            path = cache / "gguf" / f"{shape}-{t}.gguf"
            if not path.is_file():
                if not f16.is_file():
                    gguf_export.export_f16(ckpt, f16, progress=log)
                tmp = path.with_suffix(".part")
                gguf_export.quantize(f16, tmp, t, threads=threads, progress=log)
                tmp.replace(path)
            out.append(path)
    return out


def ik_binary(path: str | None) -> pathlib.Path | None:
    """The ``llama-bench`` of ik_llama.cpp given by ``--ik-bench`` or ``$OLV_IK_BENCH``; None
    when neither is set. Raises FileNotFoundError when the named file does not exist."""
    path = path or os.environ.get("OLV_IK_BENCH")
    if not path:
        return None
    p = pathlib.Path(path).expanduser()
    if not p.is_file() or not os.access(p, os.X_OK):
        raise FileNotFoundError(f"ik_llama.cpp llama-bench: {p} is not an executable file")
    return p


def ik_row(binary: pathlib.Path, gguf: pathlib.Path, threads: int, prefill_lens, new_tokens: int,
           runs: int, extra=(), timeout: float = 1800.0) -> dict:
    """ik_llama.cpp ``llama-bench -m gguf -t threads -p L1,L2 -n new_tokens -r runs -rtr 1 -o
    json`` (plus ``extra`` arguments): ``{"decode_tps", "prefill_by_len" {L: tok/s},
    "prefill_tps", "rss" (bytes, the child's peak), "cmd"}`` (rates are llama-bench's mean over
    the repetitions), or ``{"error": ...}`` when it fails or runs past ``timeout`` seconds."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(max(1, runs)),
           "-rtr", "1", "-o", "json", "-p", ",".join(str(x) for x in prefill_lens),
           "-n", str(new_tokens), *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    timer = threading.Timer(timeout, proc.kill)  # bounded: a stuck run is killed
    timer.start()
    try:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
    finally:
        timer.cancel()
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    rss = usage.ru_maxrss * 1024
    if time.monotonic() - t0 >= timeout:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": " ".join(cmd)}
    if code != 0:
        return {"error": f"llama-bench exited with {code}", "cmd": " ".join(cmd)}
    try:
        tests = {t["test"]: t for t in json.loads(out)}
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"llama-bench output not JSON ({exc})", "cmd": " ".join(cmd)}
    pf = {int(ln): tests[f"pp{ln}"]["avg_ts"] for ln in prefill_lens if f"pp{ln}" in tests}
    tg = tests.get(f"tg{new_tokens}", {}).get("avg_ts")
    return {"decode_tps": tg, "prefill_by_len": pf,
            "prefill_tps": pf[min(pf)] if pf else None, "rss": rss,
            "seconds": time.monotonic() - t0, "cmd": " ".join(cmd)}


def ik_long(binary: pathlib.Path, gguf: pathlib.Path, threads: int, contexts, new_tokens: int,
            runs: int, cache_type: str, timeout: float = 3600.0) -> dict:
    """ik_llama.cpp decode after long prompts: ``llama-bench -gp <ctx>,<new_tokens>`` for every
    context, flash attention on, K and V cache of ``cache_type`` (``q8_0``, ``f16``), ``-rtr 1``:
    ``{"decode_tps_by_context": {ctx: tok/s}, "cache_type", "cmd"}`` (llama-bench times the
    ``new_tokens`` generated after the prompt), or ``{"error": ...}``."""
    gp = []
    for c in contexts:
        gp += ["-gp", f"{int(c)},{int(new_tokens)}"]
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(max(1, runs)),
           "-rtr", "1", "-fa", "1", "-ctk", cache_type, "-ctv", cache_type, "-p", "0", "-n", "0",
           "-o", "json", *gp]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": " ".join(cmd)}
    if r.returncode != 0:
        return {"error": f"llama-bench exited with {r.returncode}", "cmd": " ".join(cmd)}
    try:
        tests = {t["test"]: t["avg_ts"] for t in json.loads(r.stdout)}
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"llama-bench output not JSON ({exc})", "cmd": " ".join(cmd)}
    return {"decode_tps_by_context": {str(c): tests.get(f"tg{new_tokens}@pp{c}")
                                      for c in contexts},
            "cache_type": cache_type, "cmd": " ".join(cmd)}


def _at(by, ln):
    """``by[ln]`` of a prefill dict whose keys are ints or (after JSON) strings."""
    by = by or {}
    return by.get(int(ln)) or by.get(str(ln))


def _r(num, den):
    return f"{num / den:.2f}x" if num and den else "-"


def _f(v, spec="{:.1f}"):
    return spec.format(v) if v else "-"


def summary(results: list, prefill_lens) -> list:
    """Markdown lines of the one-run GGUF table: per file, decode and prefill tok/s of olv int8
    activations / olv exact / llama.cpp / ik_llama.cpp, MB of weights per token, peak RSS, and
    the ratios of issue 25 (olv int8 / ik_llama.cpp for decode and each prefill; olv exact /
    llama.cpp for decode)."""
    lens = [int(x) for x in prefill_lens]
    pf = " / ".join(str(x) for x in lens)
    lines = [f"| file | MB/token | decode: olv int8 | olv exact | llama.cpp | ik_llama.cpp | "
             f"int8 / ik | exact / llama | prefill {pf}: olv int8 | olv exact | llama.cpp | "
             f"ik_llama.cpp | int8 / ik | peak RSS MB: olv int8 / llama / ik |",
             "|" + "---|" * 14]
    for g in results:
        rows = {k: g.get(k + "_row") or {} for k in ("olv_q", "olv", "llama", "ik")}

        def pfs(k):
            return " / ".join(_f(_at(rows[k].get("prefill_by_len"), ln), "{:.0f}") for ln in lens)

        ratios = []
        for ln in lens:
            ratios.append(_r(_at(rows["olv_q"].get("prefill_by_len"), ln),
                             _at(rows["ik"].get("prefill_by_len"), ln)))
        rss = " / ".join(_f((rows[k].get("rss") or 0) / 1e6, "{:.0f}")
                         for k in ("olv_q", "llama", "ik"))
        name = pathlib.Path(g["file"]).name
        lines.append(
            f"| {name} ({'/'.join(g['types'])}) | {_f(g.get('weight_bytes', 0) / 1e6)} | "
            f"{_f(rows['olv_q'].get('decode_tps'))} | {_f(rows['olv'].get('decode_tps'))} | "
            f"{_f(rows['llama'].get('decode_tps'))} | {_f(rows['ik'].get('decode_tps'))} | "
            f"{_r(rows['olv_q'].get('decode_tps'), rows['ik'].get('decode_tps'))} | "
            f"{_r(rows['olv'].get('decode_tps'), rows['llama'].get('decode_tps'))} | "
            f"{pfs('olv_q')} | {pfs('olv')} | {pfs('llama')} | {pfs('ik')} | "
            f"{' / '.join(ratios)} | {rss} |")
    return lines


def exact_vs_peak(results: list, prefill_lens, peak: dict | None) -> list:
    """Lines giving olv exact-mode prefill in GFLOP/s of the layers' linears (2 x the ``blk.*``
    weight elements per token; attention and the one lm_head row left out, so the figure is a
    lower bound) as a fraction of the measured float32 FMA peak (bench/fma_peak.py); issue 25
    asks for >= 60 % at M >= 64."""
    if not peak:
        return []
    best = peak["gflops_best"]
    lines = [f"float32 FMA peak ({peak['threads']} threads, bench/fma_peak.py): {best:.1f} "
             f"GFLOP/s best, {peak['gflops_median']:.1f} median"
             + ("" if peak.get("fma") else " (!) no FMA instruction: not a peak")]
    for g in results:
        by = (g.get("olv_row") or {}).get("prefill_by_len")
        parts = []
        for ln in prefill_lens:
            tps = _at(by, ln)
            if tps:
                gf = 2.0 * g["layer_macs"] * tps / 1e9
                parts.append(f"prefill {ln}: {gf:.1f} GFLOP/s = {100 * gf / best:.0f} % of peak")
        if parts:
            lines.append(f"olv exact on {pathlib.Path(g['file']).name}: " + ", ".join(parts))
    return lines
