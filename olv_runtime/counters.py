"""Runtime counters: allocations, payload copies by cause, dequantized bytes, workspace.

A :class:`Counters` object holds cumulative totals; :meth:`Counters.snapshot` and
:meth:`Counters.delta` give per-call figures. Counter names (all integers, bytes unless noted):

``arrays_allocated`` (count), ``bytes_allocated``, ``bytes_copied_state`` (state management),
``bytes_copied_kv_append`` (new KV tokens written), ``bytes_copied_kv_prefix`` (KV prefixes copied
into a new capacity buffer), ``kv_reallocations`` (count), ``bytes_copied_other``, ``bytes_dequantized`` (materialised decodes),
``workspace_peak``, ``retained_state_bytes``, ``model_serializations`` (count), ``runs`` (count).
"""
from __future__ import annotations

import threading

NAMES = (
    "runs",
    "arrays_allocated",
    "bytes_allocated",
    "bytes_copied_state",
    "bytes_copied_kv_append",
    "bytes_copied_kv_prefix",
    "kv_reallocations",
    "bytes_copied_other",
    "bytes_dequantized",
    "workspace_peak",
    "retained_state_bytes",
    "model_serializations",
)


class Counters:
    """Cumulative integer counters (thread-safe increments)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(NAMES, 0)

    def add(self, name: str, amount: int) -> None:
        """Add ``amount`` to counter ``name`` (KeyError for an unknown name)."""
        with self._lock:
            self._values[name] += int(amount)

    def set_max(self, name: str, value: int) -> None:
        """Raise counter ``name`` to ``value`` if larger (peaks)."""
        with self._lock:
            if value > self._values[name]:
                self._values[name] = int(value)

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = int(value)

    def snapshot(self) -> dict[str, int]:
        """A copy of all counters."""
        with self._lock:
            return dict(self._values)

    @staticmethod
    def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
        """Per-call figures: ``after - before`` for sums; peaks and levels as in ``after``."""
        out = {}
        for k in NAMES:
            if k in ("workspace_peak", "retained_state_bytes"):
                out[k] = after[k]
            else:
                out[k] = after[k] - before[k]
        return out

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def __repr__(self) -> str:
        return "Counters(" + ", ".join(f"{k}={v}" for k, v in self._values.items()) + ")"
