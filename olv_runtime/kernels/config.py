"""Numba compilation flags and threading configuration, in one place.

Every kernel module imports :data:`JIT` (serial kernels) and :data:`PJIT` (parallel drivers) from
here, so the flags are uniform across the package:

* ``cache=True``: compiled code is cached on disk (``__pycache__``) so later imports are fast.
* ``nogil=True``: kernels release the GIL; several sessions may run concurrently from threads.
* ``fastmath=False``: no reassociation / contraction, so results are deterministic and match the
  numpy references operation for operation. Kernels that want vector-friendly float reductions
  use explicit multiple accumulators (a fixed summation order) instead.
* ``error_model="numpy"``: division by zero gives inf/nan like numpy instead of raising (and
  avoids the zero-division checks in hot loops).

Threading layer
---------------
A decode token runs about a hundred parallel loops, and numba's ``workqueue`` layer costs about
120 us per parallel-loop start against about 2 us for ``omp``. The layer is therefore chosen
explicitly when this module is imported (before any parallel function is compiled or run): ``omp``
when numba's OpenMP pool can be loaded, ``workqueue`` otherwise. An explicit user choice through
the ``NUMBA_THREADING_LAYER`` environment variable is respected. :func:`threading_layer` reports the
layer in use (or the one selected, if no parallel function has run yet).
"""
from __future__ import annotations

import importlib
import threading

import numba
from numba.np.ufunc import parallel as _par

from olv_runtime.config import JIT, PJIT, numba_threading_layer

from .numba_startup import defer_blas_probe

defer_blas_probe()  # numba's first cache load would import scipy.linalg (see numba_startup)

__all__ = ["JIT", "PJIT", "set_num_threads", "get_num_threads", "threading_layer", "lazy_njit"]

# JIT / PJIT (the flags) are defined in olv_runtime.config: every numba flag in one place


class LazyDispatcher:
    """A numba function with an explicit signature, compiled (or loaded from the on-disk cache) at
    its first call instead of at import.

    ``numba.njit(signature)`` compiles eagerly when the module is imported, so every user paid
    for every kernel (the paged attention kernels alone took about 6 s of a cold ``olv demo``).
    This wrapper keeps the explicit signature (one specialisation, no per-call typing) and the
    flags, but defers the work to the first call. Only for functions called from Python; a
    jitted caller needs the real dispatcher (:attr:`dispatcher`).
    """

    def __init__(self, pyfunc, signature, flags):
        self.py_func = pyfunc
        self.signature = signature
        self.flags = dict(flags)
        self._dispatcher = None
        self._lock = threading.Lock()
        self.__name__ = getattr(pyfunc, "__name__", "lazy")
        self.__doc__ = pyfunc.__doc__
        self.__wrapped__ = pyfunc

    @property
    def dispatcher(self):
        """The compiled numba dispatcher (compiles on first access)."""
        d = self._dispatcher
        if d is None:
            with self._lock:
                d = self._dispatcher
                if d is None:
                    d = self._dispatcher = numba.njit(self.signature, **self.flags)(self.py_func)
        return d

    @property
    def compiled(self) -> bool:
        """True once the function has been compiled or loaded (by a first call)."""
        return self._dispatcher is not None

    def __call__(self, *args):
        return self.dispatcher(*args)


def lazy_njit(signature, **flags):
    """Decorator: like ``numba.njit(signature, **flags)`` but compiled at the first call
    (:class:`LazyDispatcher`)."""
    def deco(fn):
        return LazyDispatcher(fn, signature, flags)
    return deco


def _omp_available() -> bool:
    try:
        # a capability probe: the OpenMP pool needs the libgomp numba was built against
        importlib.import_module("numba.np.ufunc.omppool")
    except ImportError:
        return False
    return True


def _select_threading_layer() -> str:
    user = numba_threading_layer()
    if user and user != "default":
        return numba.config.THREADING_LAYER
    layer = "omp" if _omp_available() else "workqueue"
    numba.config.THREADING_LAYER = layer
    return layer


SELECTED_THREADING_LAYER = _select_threading_layer()


def threading_layer() -> str:
    """Name of the numba threading layer in use.

    Returns
    -------
    str
        ``"omp"``, ``"tbb"`` or ``"workqueue"``: the layer numba actually launched if a parallel
        function has already run, otherwise the layer selected at import (which numba will use).
    """
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        return str(numba.config.THREADING_LAYER)


_thread_fns = None


def thread_count_fns():
    """``(set, get)`` of the calling thread's numba thread count for per-call use: the threading
    layer's own functions once it is up (numba's public ``set_num_threads`` /
    ``get_num_threads`` launch it and check their argument at every call, ~1-2 us), else the
    public ones. The setter takes a Python int in ``[1, NUMBA_NUM_THREADS]`` (unchecked)."""
    global _thread_fns
    fns = _thread_fns
    if fns is None:
        numba.get_num_threads()  # launches the threading layer
        try:
            fns = (_par._set_num_threads, _par._get_num_threads)
            if not (callable(fns[0]) and callable(fns[1])):
                raise AttributeError("threading layer functions")
        except (ImportError, AttributeError):
            fns = (numba.set_num_threads, numba.get_num_threads)
        _thread_fns = fns
    return fns


def set_num_threads(n: int) -> None:
    """Set the number of threads used by the parallel kernels (passthrough to numba).

    Parameters
    ----------
    n : int
        1 <= n <= ``numba.config.NUMBA_NUM_THREADS``.
    """
    numba.set_num_threads(int(n))


#: Below this many scalar operations a wrapper runs the serial driver: starting a parallel region
#: costs more than the work (tens of microseconds when the worker threads are asleep).
PARALLEL_MIN_WORK = 1 << 17


def get_num_threads() -> int:
    """Number of threads the parallel kernels currently use (passthrough to numba)."""
    return int(numba.get_num_threads())


# ---------------------------------------------------------------------------------------------
# Argument validation shared by the public wrappers (kept here: the one module every kernel
# module already imports).
# ---------------------------------------------------------------------------------------------
import numpy as np  # noqa: E402

from olv_runtime.errors import InvalidArgument  # noqa: E402


def check_array(a, name: str, dtype=None, shape=None, ndim=None, contiguous: bool = True):
    """Validate one array argument of a kernel wrapper.

    Raises :class:`~olv_runtime.errors.InvalidArgument` naming ``name`` with what was expected
    and what was given. ``shape`` entries may be ``None`` (any size). Returns ``a``.
    """
    if not isinstance(a, np.ndarray):
        raise InvalidArgument(f"{name}: expected a numpy.ndarray, got {type(a).__name__}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if a.dtype not in [np.dtype(d) for d in dtypes]:
            exp = " or ".join(str(np.dtype(d)) for d in dtypes)
            raise InvalidArgument(f"{name}: expected dtype {exp}, got {a.dtype}")
    if shape is not None:
        shape = tuple(shape)
        if a.ndim != len(shape) or any(e is not None and e != g for e, g in zip(shape, a.shape)):
            exp = "[" + ", ".join("?" if e is None else str(e) for e in shape) + "]"
            raise InvalidArgument(f"{name}: expected shape {exp}, got {list(a.shape)}")
    elif ndim is not None and a.ndim != ndim:
        raise InvalidArgument(f"{name}: expected rank {ndim}, got rank {a.ndim} {list(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise InvalidArgument(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    return a


def check_out(out, name: str, dtype, shape):
    """Allocate the output (``out is None``) or validate a caller-provided one."""
    if out is None:
        return np.empty(tuple(shape), dtype=dtype)
    check_array(out, name, dtype=dtype, shape=shape)
    if not out.flags.writeable:
        raise InvalidArgument(f"{name}: expected a writeable array, got a read-only one")
    return out


def check_int(v, name: str, lo=None, hi=None) -> int:
    """Validate an integer scalar argument in [lo, hi] (inclusive bounds, None = unbounded)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise InvalidArgument(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgument(f"{name}: expected an int in [{lo}, {hi}], got {v}")
    return v
