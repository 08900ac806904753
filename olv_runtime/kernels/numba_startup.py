"""Warm-start cost of numba's first compile (or cache load) in a process.

The first time any jitted function of a process is compiled *or loaded from numba's disk cache*,
numba refreshes its target context, which imports all of its implementation registries. One of
them, ``numba.np.arraymath``, probes at import whether a BLAS is available for ``np.dot``-based
helpers by importing ``scipy.linalg``; with scipy 1.1x that import pulls in scipy's array-API
layer, which walks numpy's namespace and imports ``numpy.f2py``, ``numpy.testing``, ``unittest``,
``pydoc``, ``charset_normalizer`` ... : 0.3-0.7 s on this machine kind, most of a warm start's
time to the first token. None of olv_runtime's kernels calls BLAS.

:func:`defer_blas_probe` imports ``numba.np.arraymath`` before numba needs it, with that probe
deferred: the module's ``_HAVE_BLAS`` flag becomes a lazy truth value that runs numba's own
probe (``_check_blas``, unchanged) the first time numba reads it, i.e. when some code in the
process compiles one of the numpy functions that use it (``np.cov``, ``np.correlate``-style inner
products). Code compiled by others in the same process therefore sees exactly numba's behaviour;
only the time of the scipy import moves. ``np.dot``/``np.linalg`` implementations call numba's
``ensure_blas`` themselves when they are compiled and are not affected.

The hook is applied at most once, only to the numba versions it was written for (the module
attributes it touches must exist and be the ones described above); otherwise nothing is changed.
``OLV_NUMBA_BLAS_PROBE=eager`` disables it.

Source: numba 0.68 ``numba/np/arraymath.py`` (``_check_blas``, ``_HAVE_BLAS``),
``numba/np/linalg.py`` (``ensure_blas``), ``numba/core/cpu.py``
(``CPUContext.load_additional_registries``).
"""
from __future__ import annotations

import importlib
import sys

from olv_runtime.config import blas_probe_eager

__all__ = ["defer_blas_probe", "LazyProbe"]


class LazyProbe:
    """A truth value computed by ``probe()`` on first use (then remembered)."""

    __slots__ = ("_probe", "_value")

    def __init__(self, probe):
        self._probe = probe
        self._value = None

    def __bool__(self) -> bool:
        if self._value is None:
            self._value = bool(self._probe())
        return self._value

    def __repr__(self) -> str:
        state = "not probed yet" if self._value is None else repr(self._value)
        return f"LazyProbe({state})"


_APPLIED = False


def defer_blas_probe() -> bool:
    """Import ``numba.np.arraymath`` with its BLAS probe deferred (module docstring).

    Returns
    -------
    bool
        True when the probe was deferred by this call; False when numba already imported the
        module (too late: the probe has run), the hook is disabled, already applied, or this
        numba does not have the expected attributes.
    """
    global _APPLIED
    if _APPLIED or blas_probe_eager():
        return False
    if "numba.np.arraymath" in sys.modules:
        return False
    _APPLIED = True
    # imported here, at this moment, on purpose: the hook must be in place before numba's
    # arraymath is first imported (the whole point of this function)
    linalg = importlib.import_module("numba.np.linalg")

    probe = getattr(linalg, "ensure_blas", None)
    if probe is None:
        return False

    def deferred():
        raise ImportError("BLAS probe deferred by olv_runtime.kernels.numba_startup")

    linalg.ensure_blas = deferred
    try:
        arraymath = importlib.import_module("numba.np.arraymath")
    finally:
        linalg.ensure_blas = probe
    if (getattr(arraymath, "ensure_blas", None) is not deferred
            or not callable(getattr(arraymath, "_check_blas", None))
            or getattr(arraymath, "_HAVE_BLAS", None) is not False):
        # not the module layout this hook was written for: leave numba's result in place
        if getattr(arraymath, "ensure_blas", None) is deferred:
            arraymath.ensure_blas = probe
        if getattr(arraymath, "_HAVE_BLAS", None) is False and callable(
                getattr(arraymath, "_check_blas", None)):
            arraymath._HAVE_BLAS = arraymath._check_blas()
        return False
    arraymath.ensure_blas = probe
    arraymath._HAVE_BLAS = LazyProbe(arraymath._check_blas)
    return True
