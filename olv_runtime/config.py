"""Configuration in one place: every ``OLV_*`` environment variable, the environment variables of
other tools the runtime reads (``NUMBA_THREADING_LAYER``, ``XDG_CACHE_HOME``) and the numba
compilation flags. No other module of the package reads ``os.environ``
(``tests/test_architecture.py`` checks it).

Environment variables (each read when the function that names it is called, unless noted):

================================ ======================================================================
``OLV_ISA``                      ``avx2`` forces the AVX2 int8-dot path; ``avx512vnni`` only where the
                                 CPU has it; unset/empty: chosen from the CPU
                                 (:func:`olv_runtime.kernels.packed_i8.isa`; read once, at import)
``OLV_WEIGHT_ARENA``             ``1`` (default) prepacked weights on 2 MiB pages, ``0`` plain arrays
``OLV_COMPILE_WORKERS``          ``0`` never / ``1`` always / unset, empty or ``auto`` (>= 2 CPUs): a
                                 worker process compiles the decode step
``OLV_PRECOMPILE_SHARED``        set to ``1`` by the runtime for its compile workers (not for users)
``OLV_NUMBA_BLAS_PROBE``         ``eager``: let numba probe scipy's BLAS at its first cache load
``OLV_VERIFY_DIGESTS``           ``full``: hash every compiled payload at every load; unset/empty:
                                 remember verified files by identity
``OLV_CACHE_DIR``                where verified digests are remembered (default
                                 ``$XDG_CACHE_HOME/olv_runtime`` or ``~/.cache/olv_runtime``)
``NUMBA_THREADING_LAYER``        numba's own variable: an explicit choice is respected
================================ ======================================================================

A value outside the accepted set raises :class:`olv_runtime.errors.EnvironmentVariableError`
naming the variable, its value and what is accepted.
"""
from __future__ import annotations

import os
import pathlib

from olv_runtime.errors import env_error

__all__ = ["JIT", "PJIT", "LAZY_IMPORTS", "isa_override", "weight_arena_enabled",
           "compile_workers", "precompile_shared", "worker_environment", "blas_probe_eager",
           "digest_cache_key", "digest_cache_dir", "numba_threading_layer"]

#: numba flags of serial kernels (``@njit(**JIT)``); see :mod:`olv_runtime.kernels.config`
JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
#: numba flags of parallel drivers
PJIT = dict(JIT, parallel=True)

#: Third-party packages imported inside the functions that need them (the only imports allowed
#: inside functions, ``tests/test_architecture.py``): optional extras, or required packages whose
#: import costs tens to hundreds of milliseconds that a decode does not need (warm start).
LAZY_IMPORTS = frozenset({
    "torch", "transformers", "accelerate", "matplotlib", "onnxruntime", "onnxruntime_genai",
    "llama_cpp", "gguf", "psutil",           # optional: references, plots, benchmarks
    "llguidance", "starlette", "uvicorn", "prometheus_client",  # optional: olv serve (serve extra)
    "ray",                                   # optional: olv serve --replicas (ray extra)
    "onnx", "jinja2", "tokenizers", "safetensors", "ml_dtypes", "tqdm",  # required, imported late
})


def isa_override() -> str | None:
    """``OLV_ISA`` lower-cased, or None when unset or empty (checked by the caller)."""
    return os.environ.get("OLV_ISA", "").strip().lower() or None


def weight_arena_enabled() -> bool:
    """``OLV_WEIGHT_ARENA``: ``1``, unset or empty -> True; ``0`` -> False."""
    v = os.environ.get("OLV_WEIGHT_ARENA", "1").strip()
    if v == "1" or v == "":
        return True
    if v == "0":
        return False
    raise env_error("OLV_WEIGHT_ARENA", v, "'1' (the default: on), '0' (off)")


def compile_workers() -> str:
    """``OLV_COMPILE_WORKERS``: ``"0"``, ``"1"`` or ``"auto"`` (unset, empty or ``auto``)."""
    env = os.environ.get("OLV_COMPILE_WORKERS", "").strip()
    if env in ("0", "1"):
        return env
    if env not in ("", "auto"):
        raise env_error("OLV_COMPILE_WORKERS", env,
                        "'0' (never), '1' (always), unset, empty or 'auto' (when >= 2 CPUs)")
    return "auto"


def precompile_shared() -> bool:
    """``OLV_PRECOMPILE_SHARED=1``: this process is a compile worker saving into its parent's
    numba cache."""
    return os.environ.get("OLV_PRECOMPILE_SHARED") == "1"


def worker_environment(shared: bool, cache_dir: str | None) -> dict[str, str]:
    """The environment of a compile worker: this process's, with ``OLV_PRECOMPILE_SHARED=1`` when
    it saves into the shared numba cache, else its own ``NUMBA_CACHE_DIR`` (``cache_dir``)."""
    env = dict(os.environ)
    if shared:
        env["OLV_PRECOMPILE_SHARED"] = "1"
    else:
        env["NUMBA_CACHE_DIR"] = cache_dir
        env.pop("OLV_PRECOMPILE_SHARED", None)
    return env


def blas_probe_eager() -> bool:
    """``OLV_NUMBA_BLAS_PROBE=eager``: leave numba's BLAS probe as numba does it."""
    return os.environ.get("OLV_NUMBA_BLAS_PROBE", "").strip().lower() == "eager"


def digest_cache_key() -> tuple:
    """The variables :func:`digest_cache_dir` depends on (a memo key)."""
    return (os.environ.get("OLV_VERIFY_DIGESTS", ""), os.environ.get("OLV_CACHE_DIR"),
            os.environ.get("XDG_CACHE_HOME"))


def digest_cache_dir() -> pathlib.Path | None:
    """The directory where verified compiled-payload digests are remembered, or None when
    ``OLV_VERIFY_DIGESTS=full`` (hash at every load)."""
    mode = os.environ.get("OLV_VERIFY_DIGESTS", "").strip().lower()
    if mode == "full":
        return None
    if mode != "":
        raise env_error("OLV_VERIFY_DIGESTS", os.environ["OLV_VERIFY_DIGESTS"],
                        "'full' (hash every payload at every load), unset or empty (the "
                        "default: remember verified files by identity)")
    base = os.environ.get("OLV_CACHE_DIR")
    if base:
        root = pathlib.Path(base)
        # the nearest existing ancestor must be a directory (``/dev/null/x`` can never be made)
        p = root.absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        if not p.is_dir():
            raise env_error("OLV_CACHE_DIR", base, f"a directory or a path creatable as one "
                            f"({str(p)!r} exists and is not a directory)")
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = pathlib.Path(xdg) / "olv_runtime" if xdg else pathlib.Path.home() / ".cache" / "olv_runtime"
    return root / "verified-digests"


def numba_threading_layer() -> str:
    """``NUMBA_THREADING_LAYER`` lower-cased ("" when unset)."""
    return os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
