"""Runtime counters: allocations, payload copies by cause, dequantized bytes, workspace, retained
state and model serializations (DESIGN §3 "Counters"; seed 000 PR04b/PR07 acceptance).

A :class:`Counters` object holds cumulative totals (each :class:`~olv_runtime.InferenceSession`
has one, ``session.counters``); :meth:`Counters.snapshot` and :meth:`Counters.delta` give
per-call figures. :func:`recording` collects, exactly, everything counted by *any* counters object
on the current thread while it is active: :class:`~olv_runtime.state.State` uses it for its
per-call (``state.last_counters``) and per-state cumulative (``state.counters``) figures, so
two states running on one session in two threads never mix their numbers.

Counter names (integers; bytes unless noted):

=============================== ==================================================================
``runs``                        (count) graph executions
``arrays_allocated``            (count) arrays allocated while running: step outputs whose memory
                                is new (not a view of a constant, feed or earlier array) and
                                KV capacity buffers (counted by :mod:`olv_runtime.kv.contiguous`)
``bytes_allocated``             bytes of those arrays
``bytes_copied_state``          payload bytes copied by state management (retaining initial
                                values, outputs and next-call inputs). Measured, not assumed:
                                the state compares the data pointer of every value it retains
                                with the pointer of the array it was given. Must stay 0.
``bytes_copied_kv_append``      new KV tokens written into capacity buffers
``bytes_copied_kv_prefix``      KV prefixes copied into a new capacity buffer (growth/branching)
``kv_reallocations``            (count) new KV capacity buffers
``bytes_copied_other``          other payload copies reported by kernels
``bytes_dequantized``           bytes of tensors materialised by decoding an encoded value
``workspace_peak``              (level, max) peak bytes of arrays allocated by a run and alive
                                at the same time (activations; KV buffers excluded)
``retained_state_bytes``        (level) bytes of retained state values (logical, ``nbytes`` of
                                the retained views); the session's figure sums its open states
``retained_state_buffer_bytes`` (level) bytes of the distinct buffers behind the retained values
                                (KV capacity included)
``model_serializations``        (count) serializations, clones or whole-message comparisons of
                                a ModelProto / GraphProto / FunctionProto (see
                                :func:`install_model_guard`); 0 during state construction and runs
``payload_bytes_read`` /        encoded payload bytes read or copied while validating and
``payload_bytes_copied``        binding values at session creation (zero-copy views count nothing)
``bytes_repacked``              bytes written by native consumers that repack encoded blocks
                                into a kernel layout at session creation (GGUF ggml blocks ->
                                INT4 codes, scales, offsets; ``structs/ggml_native.py``), by
                                the conversion of foreign quantized weights into the INT4 form
                                (UINT4 -> INT4, [K, N] -> [N, K]; ``recognize.py``), and
                                by the INT4 linear prepacking (``fusion.LinearStep``; 0 for
                                weights served by seed 004 compiled entries): a layout change,
                                not a payload copy
``kv_blocks_allocated``         (count) paged KV block slots taken (K and V sides counted apart;
                                :mod:`olv_runtime.kv.paged`)
``bytes_kv_converted``          payload bytes of paged KV block sides converted at sealing (the
                                source slot's bytes)
``kv_blocks_converted``         (count) block sides converted at sealing
``bytes_read_kv_attention``     KV payload bytes (codes and scales) read by paged attention
``kv_committed_bytes``          bytes of the block slots held by the present paged caches a call
                                produced (summed over layers; per call, not meaningful summed)
``attention_workspace_peak``    (level, max) bytes of the paged attention workspace (running
                                max/sum/accumulator and row scratch); independent of context
``compiled_hits``               (count) seed 004 compiled entries a session used instead of
``compiled_misses``             repacking, and entries it rejected (cache misses, see
                                :mod:`olv_runtime.structs.compiled`; the reasons are logged)
``bytes_digest_verified``       bytes hashed at session creation to verify source / compiled
                                digests (0 when the verifications are cached)
=============================== ==================================================================
"""
from __future__ import annotations

import contextvars
import functools
import threading
import weakref

import numpy as np

from olv_runtime.pool import owner as _owner  # the array owning a view's memory
from olv_runtime.proto import FunctionProto, GraphProto, ModelProto

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
    "retained_state_buffer_bytes",
    "model_serializations",
    "payload_bytes_read",
    "payload_bytes_copied",
    "bytes_repacked",
    "kv_blocks_allocated",
    "bytes_kv_converted",
    "kv_blocks_converted",
    "bytes_read_kv_attention",
    "kv_committed_bytes",
    "attention_workspace_peak",
    "compiled_hits",
    "compiled_misses",
    "bytes_digest_verified",
)

#: Counters that are levels (a per-call figure is the value after the call, not a difference).
LEVELS = frozenset({"workspace_peak", "retained_state_bytes", "retained_state_buffer_bytes",
                    "attention_workspace_peak"})

#: Level counters that merge as a maximum (peaks).
PEAKS = frozenset({"workspace_peak", "attention_workspace_peak"})

_SUMS = tuple(k for k in NAMES if k not in LEVELS)
_SET_LEVELS = tuple(k for k in NAMES if k in LEVELS and k not in PEAKS)

#: The Counters objects recording on the current thread / context (innermost last).
_scopes: contextvars.ContextVar[tuple] = contextvars.ContextVar("olv_counters_scopes", default=())


class Counters:
    """Cumulative integer counters (thread-safe).

    Every :meth:`add`, :meth:`set_max` and :meth:`set` is also applied to the counters of any
    :func:`recording` active on the calling thread.
    """

    #: Count run allocations and workspace (:class:`RunMeter`, about 2 us per step).
    track_allocations = True

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(NAMES, 0)

    def _apply(self, op: str, name: str, amount: int) -> None:
        with self._lock:
            if op == "add":
                self._values[name] += amount
            elif op == "max":
                if amount > self._values[name]:
                    self._values[name] = amount
            else:
                self._values[name] = amount

    def _dispatch(self, op: str, name: str, amount: int, propagate: bool) -> None:
        if name not in self._values:
            raise KeyError(f"unknown counter {name!r}; counters are {list(NAMES)}")
        amount = int(amount)
        self._apply(op, name, amount)
        if propagate:
            for scope in _scopes.get():
                if scope is not self:
                    scope._apply(op, name, amount)

    def add(self, name: str, amount: int, *, propagate: bool = True) -> None:
        """Add ``amount`` to counter ``name`` (KeyError for an unknown name).

        ``propagate=False`` leaves active :func:`recording` scopes alone."""
        values = self._values
        if name not in values:
            raise KeyError(f"unknown counter {name!r}; counters are {list(NAMES)}")
        amount = int(amount)
        with self._lock:
            values[name] += amount
        if propagate:
            for scope in _scopes.get():
                if scope is not self:
                    with scope._lock:
                        scope._values[name] += amount

    def set_max(self, name: str, value: int, *, propagate: bool = True) -> None:
        """Raise counter ``name`` to ``value`` if larger (peaks)."""
        self._dispatch("max", name, value, propagate)

    def set(self, name: str, value: int, *, propagate: bool = True) -> None:
        """Set level counter ``name`` to ``value``."""
        self._dispatch("set", name, value, propagate)

    def merge(self, other: "Counters | dict[str, int]") -> None:
        """Accumulate per-call figures ``other``: sums added, levels as in ``other`` (peaks max)."""
        values = other.snapshot() if isinstance(other, Counters) else other
        get = values.get
        with self._lock:
            mine = self._values
            for k in filter(get, _SUMS):  # the non-zero sums (a C-level scan)
                mine[k] += int(values[k])
            for k in _SET_LEVELS:
                mine[k] = int(get(k, 0))
            for k in PEAKS:
                v = int(get(k, 0))
                if v > mine[k]:
                    mine[k] = v

    def snapshot(self) -> dict[str, int]:
        """A copy of all counters."""
        with self._lock:
            return dict(self._values)

    @staticmethod
    def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
        """Per-call figures: ``after - before`` for sums; levels and peaks as in ``after``."""
        return {k: after[k] if k in LEVELS else after[k] - before[k] for k in NAMES}

    def run_meter(self, pool=None, kv_length=None) -> "RunMeter | _NoMeter":
        """A :class:`RunMeter` for one run (a no-op one when ``track_allocations`` is False).

        Buffers of ``pool`` (an :class:`olv_runtime.pool.BufferPool`) are not counted here: the
        pool counts the ones it allocates and reuses the rest. ``kv_length(view) -> int | None``
        (:func:`olv_runtime.kv.contiguous.committed_length`) tells KV capacity buffers apart:
        their in-place appends are not allocations."""
        return RunMeter(self, pool, kv_length) if self.track_allocations else _NO_METER

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def __repr__(self) -> str:
        return "Counters(" + ", ".join(f"{k}={v}" for k, v in self._values.items()) + ")"


class recording:
    """Collect everything counted on this thread while the block runs
    (``with recording() as rec:``).

    Yields
    ------
    Counters
        Fresh counters receiving every ``add``/``set_max``/``set`` made by any
        :class:`Counters` (session counters, the process counters of :data:`PROCESS`, ...)
        from this thread (context) until the block exits. Scopes nest.
    """

    __slots__ = ("rec", "_token")

    def __init__(self):
        self.rec = Counters()

    def __enter__(self) -> Counters:
        self._token = _scopes.set(_scopes.get() + (self.rec,))
        return self.rec

    def __exit__(self, *exc) -> bool:
        _scopes.reset(self._token)
        return False


#: Process-wide counters: model serializations counted by :func:`install_model_guard`.
PROCESS = Counters()


# -- allocations and workspace of one run ------------------------------------------------------
def _no_kv(view) -> None:
    return None


class RunMeter:
    """Counts the arrays a run allocates and the peak of their live bytes.

    ``session.run_env`` calls :meth:`step` after each step with the step's input and output
    values. An output is an allocation when the array owning its memory is neither the owner of
    one of the step's inputs nor an array already seen in this run (so views, ``Identity``,
    ``Reshape`` and in-place KV appends count nothing). KV capacity buffers are skipped (the KV
    registry counts them). Live bytes drop when an allocated array is garbage collected
    (a weak reference callback), so ``workspace_peak`` is the peak of the activations alive at
    once; scratch arrays private to a kernel are not visible here.
    """

    __slots__ = ("counters", "_seen", "_live", "_peak", "_count", "_bytes", "_kv", "_pool",
                 "__weakref__")

    def __init__(self, counters: Counters, pool=None, kv_length=None):
        self.counters = counters
        self._pool = pool
        self._seen: dict[int, weakref.ref] = {}
        self._live = 0
        self._peak = 0
        self._count = 0
        self._bytes = 0
        self._kv = _no_kv if kv_length is None else kv_length

    def step(self, args, results) -> None:
        """Record the outputs ``results`` of one step that read ``args``."""
        inputs = None
        seen = self._seen
        held = self._pool._held if self._pool is not None else {}
        for r in results:
            if type(r) is not np.ndarray:
                continue
            own = r if r.base is None else _owner(r)
            key = id(own)
            if key in held:
                continue  # pool buffer: counted by the pool when it was first allocated
            ref = seen.get(key)
            if ref is not None and ref() is own:
                continue
            if inputs is None:
                inputs = {id(a if a.base is None else _owner(a))
                          for a in args if type(a) is np.ndarray}
            if key in inputs:
                continue
            n = own.nbytes
            if n == 0 or (own.ndim == 4 and self._kv(r) is not None):
                continue
            seen[key] = weakref.ref(own, self._callback(n))
            self._count += 1
            self._bytes += n
            self._live += n
            if self._live > self._peak:
                self._peak = self._live

    def _callback(self, nbytes: int):
        me = weakref.ref(self)

        def freed(_ref):
            meter = me()
            if meter is not None:
                meter._live -= nbytes

        return freed

    def finish(self) -> None:
        """Publish the run's figures to the counters."""
        self.counters.add("arrays_allocated", self._count)
        self.counters.add("bytes_allocated", self._bytes)
        self.counters.set_max("workspace_peak", self._peak)


class _NoMeter:
    __slots__ = ()

    def step(self, args, results) -> None:
        pass

    def finish(self) -> None:
        pass


_NO_METER = _NoMeter()


# -- model serialization guard -------------------------------------------------------------------
_GUARDED = ("SerializeToString", "SerializePartialToString", "CopyFrom", "MergeFrom",
            "__deepcopy__", "__copy__", "__reduce__", "__eq__")
_guard_installed = False


def install_model_guard() -> None:
    """Count every serialization/clone/comparison of olv_runtime's container messages.

    Wraps ``SerializeToString``, ``SerializePartialToString``, ``CopyFrom``, ``MergeFrom``,
    ``__deepcopy__``, ``__copy__``, ``__reduce__`` (pickle) and ``__eq__`` of
    :class:`~olv_runtime.proto.ModelProto`, ``GraphProto`` and ``FunctionProto`` so each call adds
    1 to ``model_serializations`` of :data:`PROCESS` (and so of any active :func:`recording`).
    Explicit save (:func:`olv_runtime.save`) counts; state construction and runs must not
    (seed 000: "State construction and subsequent calls must not serialize, clone, hash or
    repeatedly compare the model"). Idempotent; installed when this module is imported.
    """
    global _guard_installed
    if _guard_installed:
        return
    for cls in (ModelProto, GraphProto, FunctionProto):
        for meth in _GUARDED:
            orig = getattr(cls, meth, None)
            if orig is None:
                continue
            setattr(cls, meth, _counted(orig))
    _guard_installed = True


def _counted(orig):
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        PROCESS.add("model_serializations", 1)
        return orig(self, *args, **kwargs)

    wrapper.__olv_counted__ = orig
    return wrapper


install_model_guard()
