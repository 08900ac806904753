"""Request-local persistent state bound by ``GraphProto.persistent_bindings`` (seed 000 PR04a,
PR04b; "Persistent state from model inputs and outputs", "Minimal rules", "Zero-copy ownership
from the first state implementation").

Equivalent to the stateless loop of seed 000::

    feeds = {"input_ids": ids, **state.values}
    outputs = run(model, feeds)
    state.values = {inp: outputs[out] for inp, out in bindings}

but

* the retained values are the arrays themselves — the caller's initial arrays (numpy, or torch
  CPU tensors viewed through DLPack) and then the output arrays of each call — never payload
  copies. Every retained value's data pointer is compared with the pointer of the array it came
  from; a difference would be counted in ``bytes_copied_state`` (it stays 0);
* the next values are built and validated before they are published, in one assignment, after
  the call succeeded: a failed or interrupted call (kernel error, ``KeyboardInterrupt``)
  publishes nothing and the previous values and buffers stay valid;
* a second ``run``/``reset``/``close`` while a call is in flight raises :class:`StateError` at
  once (never blocks);
* retained values and the bound outputs returned by ``run`` are read-only views: a returned view
  stays valid after ``reset``, ``close`` and later calls (KV appends only write slots no view
  covers, :mod:`olv_runtime.kv.contiguous`);
* the model is never serialized, cloned or compared (``model_serializations`` stays 0; see
  :func:`olv_runtime.counters.install_model_guard`).

Counters: ``state.last_counters`` (the last call, reset or the construction),
``state.counters`` (cumulative for this state), ``state.construction_counters``; the session's
``session.counters`` sum every state and stateless run on it.
"""
from __future__ import annotations

import collections.abc as _abc
import dataclasses
import threading
import types
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from olv_runtime.counters import Counters, _scopes, recording
from olv_runtime.counters import _owner as _buffer_owner
from olv_runtime.decoding import resolve as _resolve
from olv_runtime.errors import BindingError, InvalidArgument, StateError
from olv_runtime.executor.session import (
    InferenceSession,
    SessionOptions,
    check_tensor,
    tensor_spec,
)
from olv_runtime.io import as_model
from olv_runtime.lazy import lazy_module
from olv_runtime.proto.helper import declared_shape
from olv_runtime.state.bindings import resolve_bindings
from olv_runtime.structs.initializers import NP_DTYPE
from olv_runtime.structs.runtime import RuntimeStruct, empty_value, field_arrays

files = lazy_module("olv_runtime.state.files")  # State.save only


@dataclasses.dataclass
class StateOptions:
    """Options of :func:`make_state`.

    Attributes
    ----------
    session_options : SessionOptions, optional
        Used when ``make_state`` creates the session itself.
    """

    session_options: SessionOptions | None = None


def _readonly(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr`` (same buffer, no copy)."""
    view = arr.view()
    view.flags.writeable = False
    return view


def _data_ptr(value) -> int | None:
    """Address of the first element of a numpy array or torch-like tensor (None if unknown)."""
    if isinstance(value, np.ndarray):
        return value.__array_interface__["data"][0]
    ptr = getattr(value, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    return None


class _Binding:
    """One resolved binding: input/output names, the input's ValueInfo, stride permission."""

    __slots__ = ("input", "output", "info", "strided", "spec", "kind")

    def __init__(self, inp: str, out: str, info, strided: bool):
        self.input, self.output, self.info, self.strided = inp, out, info, strided
        self.spec = tensor_spec(info)  # parsed once; check_tensor runs per call
        self.kind = info.type.WhichOneof("value")


class _TensorGroup:
    """Tensor bindings whose inputs declare one element type, one fixed-dimension pattern and
    one stride permission (e.g. every layer's past key and value): their outputs are checked
    together per call (:meth:`State._retain_all`), each distinct shape once."""

    __slots__ = ("bindings", "dtype", "rank", "fixed", "strided")

    def __init__(self, bindings, spec, strided):
        self.bindings = bindings
        self.dtype = spec.dtype
        self.rank = None if spec.shape is None else len(spec.shape)
        self.fixed = tuple((i, d) for i, d in enumerate(spec.shape or ()) if isinstance(d, int))
        self.strided = strided

    def check(self, values) -> bool:
        """True when every value is a numpy array of the group's type, rank, fixed dimensions
        and (unless strided) C-contiguous -- what :func:`check_tensor` accepts as it is."""
        for v in values:
            if type(v) is not np.ndarray:
                return False
        if {v.dtype for v in values} != {self.dtype}:
            return False
        rank, fixed = self.rank, self.fixed
        for shape in {v.shape for v in values}:
            if rank is not None and len(shape) != rank:
                return False
            for i, d in fixed:
                if shape[i] != d:
                    return False
        if not self.strided:
            for v in values:
                if not v.flags.c_contiguous:
                    return False
        return True


def _tensor_groups(resolved) -> tuple[list, list]:
    """(groups of tensor bindings, the other bindings)."""
    groups: dict = {}
    rest = []
    for b in resolved:
        sp = b.spec
        if b.kind != "tensor_type" or sp.dtype is None:
            rest.append(b)
            continue
        pattern = None if sp.shape is None else tuple(
            d if isinstance(d, int) else None for d in sp.shape)
        groups.setdefault((sp.dtype.str, pattern, b.strided), []).append(b)
    return [_TensorGroup(bs, bs[0].spec, bs[0].strided) for bs in groups.values()], rest


class _Rec:
    """The context of one call's counters (:meth:`State._call`): a :func:`recording` scope
    whose figures become ``last_counters`` (with the state's retained-bytes levels) and are
    merged into ``counters`` when the call ends (also on error)."""

    __slots__ = ("state", "token", "rec")

    def __init__(self, state):
        self.state = state

    def __enter__(self):
        rec = self.rec = Counters()
        self.token = _scopes.set(_scopes.get() + (rec,))
        return rec

    def __exit__(self, *exc):
        _scopes.reset(self.token)
        state = self.state
        vals = self.rec._values  # the scope has ended: nothing writes these any more
        vals["retained_state_bytes"] = state._level[0]
        vals["retained_state_buffer_bytes"] = state._level[1]
        state.last_counters = vals
        state.counters.merge(vals)
        return False


def _release_level(counters: Counters, level: list) -> None:
    counters.add("retained_state_bytes", -level[0], propagate=False)
    counters.add("retained_state_buffer_bytes", -level[1], propagate=False)
    level[0] = level[1] = 0


_NO_NAMES = frozenset()


class _Steady:
    """The form of a state's next call that skips the generic path's checks
    (:meth:`State._run_steady`): the feed's name, dtype, shape and strides (as checked in the
    call that made this), the ``(output, input)`` pairs object of the in-place KV append
    (:meth:`InferenceSession.run_env`'s ``appended``), the bindings as ``(input, output)``, the
    bytes one more position adds to the retained values, the session's decode program (or
    None) with the bound inputs' ``(name, index in its KV order)`` in binding order, and the
    ``outputs`` argument of the call that made it (checked then; a steady call must pass the
    same object or None)."""

    __slots__ = ("name", "dtype", "shape", "strides", "pairs", "io", "per_pos", "program",
                 "order", "last_outputs")

    def __init__(self, name, dtype, shape, strides, pairs, io, per_pos, program, order,
                 last_outputs):
        self.name, self.dtype, self.shape, self.strides = name, dtype, shape, strides
        self.pairs, self.io, self.per_pos = pairs, io, per_pos
        self.program, self.order = program, order
        self.last_outputs = last_outputs


class _SpanValues(_abc.Mapping):
    """Retained values held as a :class:`~olv_runtime.executor.decoder_step.KVSpan` (a steady decode
    through the session's decode program): a read-only mapping, input name -> read-only
    ``[:, :, :n]`` view, whose views are made when it is first read (then the same objects at
    every read). ``order``: ``(input name, index in the span)`` in binding order."""

    __slots__ = ("_order", "_span", "_map")

    def __init__(self, order, span):
        self._order = order
        self._span = span
        self._map = None

    def _m(self) -> dict:
        m = self._map
        if m is None:
            views = self._span.views()
            m = self._map = {n: views[j] for n, j in self._order}
        return m

    def __getitem__(self, name):
        return self._m()[name]

    def __iter__(self):
        return iter(self._m())

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name) -> bool:
        return name in self._m()

    def copy(self) -> dict:
        return dict(self._m())

    def __repr__(self) -> str:
        return f"mappingproxy({self._m()!r})"


def _steady_eligible(session, resolved, other) -> bool:
    """Whether a state with these bindings may take steady calls: every binding a tensor whose
    input accepts strided views (a KV past) and declares rank 4 with a symbolic axis 2 (or no
    shape), and every symbolic dimension either names only bound inputs' axis 2 or none of
    them (so one more position on every bound input keeps every dimension agreement)."""
    if other or not resolved:
        return False
    bound = set()
    for b in resolved:
        if b.kind != "tensor_type" or not b.strided or b.spec.dtype is None:
            return False
        shape = b.spec.shape
        if shape is not None and (len(shape) != 4 or isinstance(shape[2], int)):
            return False
        bound.add((b.input, 2))
    for pairs in session.symbolic_groups:
        inside = [p in bound for p in pairs]
        if any(inside) and not all(inside):
            return False
    return True


class State:
    """Request-local state of one model: the retained values of its persistently bound inputs.

    Create with :func:`make_state`. ``run(feeds)`` per call, ``values`` for read-only shared
    views of the retained values, ``reset(initial)`` to start over, ``close()`` to release;
    usable as a context manager (``with make_state(...) as state:``).

    Attributes
    ----------
    counters : Counters
        Cumulative figures of this state (construction, every call and reset).
    last_counters : dict
        Figures of the last call, reset or the construction (see :mod:`olv_runtime.counters`).
    construction_counters : dict
        Figures of ``make_state`` (session creation when it made one, binding resolution,
        initial values). ``model_serializations`` and ``bytes_copied_state`` are 0.
    tokens : list of int
        Token bookkeeping of :func:`olv_runtime.generate`: the sequence so far (prompts and
        generated ids). Empty for a new state; cleared by :meth:`reset`.
    cached_tokens : int
        How many leading entries of ``tokens`` the retained KV cache holds; the rest are
        pending (fed at the start of the next ``generate`` call).
    rng : numpy.random.Generator or None
        The sampling generator ``generate`` continues when called without a seed.
    """

    def __init__(self, session: InferenceSession, bindings: list[tuple[str, str]],
                 initial: Mapping[str, Any]):
        self._session = session
        self._bindings = list(bindings)
        infos = session.input_infos
        self._resolved = [_Binding(i, o, infos[i], session.accepts_strided(i)) for i, o in bindings]
        self._by_input = {b.input: b for b in self._resolved}
        self._groups, self._other = _tensor_groups(self._resolved)
        self._lock = threading.Lock()
        self._closed = False
        self._level = [0, 0]  # retained bytes (logical, buffers) counted in the session
        self._finalizer = weakref.finalize(self, _release_level, session.counters, self._level)
        self.counters = Counters()
        self.last_counters: dict[str, int] = {}
        self.construction_counters: dict[str, int] = {}
        self._values: Mapping[str, np.ndarray] = types.MappingProxyType({})
        self.tokens: list[int] = []
        self.cached_tokens = 0
        self.rng = None
        # the steady call (_Steady): set after a call that may be repeated without re-checks
        self._steady = None
        self._steady_ok = _steady_eligible(session, self._resolved, self._other)
        self._span = None  # the KVSpan behind _values after a decode-program call
        with self._call():
            self._publish(self._check_initial(initial, "initial"))

    # -- helpers ---------------------------------------------------------------------------
    def _call(self):
        """Record one call's counters into ``last_counters`` and ``counters`` (also on error)."""
        return _Rec(self)

    def _retain(self, b: _Binding, value: Any, what: str) -> np.ndarray:
        """Validate ``value`` for bound input ``b`` and return the read-only view to retain."""
        if b.kind == "struct_type":
            # A whole struct value: retained as it is, field by field (tensor, encoded and
            # sequence fields keep their own buffers); arrays are exposed as read-only views.
            try:
                value = self._session.check_struct(b.input, value)
            except InvalidArgument as exc:
                raise InvalidArgument(f"{what} for persistent input {b.input!r}: {exc}") from None
            return value.readonly()
        if b.kind != "tensor_type":
            raise InvalidArgument(
                f"{what} for {b.input!r}: the input is a {b.kind}; only tensor state values "
                "are supported"
            )
        try:
            arr = check_tensor(b.input, value, b.spec, b.strided)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{what} for persistent input {b.input!r}: {exc}") from None
        if arr is value:  # the array itself: same first element by construction
            # already read-only (e.g. a KV present view): retained as it is, no second view
            return arr if not arr.flags.writeable else _readonly(arr)
        view = _readonly(arr)
        src = _data_ptr(value)
        if src is not None and view.nbytes and src != view.__array_interface__["data"][0]:
            self._session.counters.add("bytes_copied_state", view.nbytes)  # never expected
        return view

    def _retain_all(self, outputs: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
        """:meth:`_retain` of every bound output (input name -> retained value). A group of
        tensor bindings whose outputs all pass the group check at once is retained without a
        per-value check (the same acceptance as :func:`check_tensor`: arrays themselves, no
        copy); any other value goes through :meth:`_retain`, which raises the specific error."""
        new = {}
        for g in self._groups:
            bs = g.bindings
            vals = [outputs[b.output] for b in bs]
            if g.check(vals):
                for b, v in zip(bs, vals):
                    new[b.input] = _readonly(v) if v.flags.writeable else v
            else:
                for b, v in zip(bs, vals):
                    new[b.input] = self._retain(b, v, what.format(b.output))
        for b in self._other:
            new[b.input] = self._retain(b, outputs[b.output], what.format(b.output))
        return {b.input: new[b.input] for b in self._resolved}  # binding order

    def _check_initial(self, initial: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
        if not isinstance(initial, Mapping):
            raise InvalidArgument(
                f"{what} must be a dict of input name -> array, got {type(initial).__name__}"
            )
        for name in initial:
            if name not in self._by_input:
                raise InvalidArgument(
                    f"{what} value {name!r} is not a persistently bound input; bound inputs: "
                    f"{sorted(self._by_input)}"
                )
        values = {}
        for b in self._resolved:
            if b.input not in initial:
                raise StateError(
                    f"missing {what} value for persistent input {b.input!r} (bound to output "
                    f"{b.output!r}); every bound input needs one"
                )
            values[b.input] = self._retain(b, initial[b.input], f"{what} value")
        self._session.check_symbolic_dims(values)  # e.g. per-layer past lengths agree
        return values

    def _publish(self, values: dict[str, np.ndarray]) -> None:
        """Make ``values`` the retained state (one assignment) and update the level counters."""
        logical = sum([v.nbytes for v in values.values()])
        owners = {}
        for v in values.values():
            if type(v) is np.ndarray:
                own = v.base  # numpy collapses view chains: usually the owner itself
                if own is None:
                    own = v
                elif type(own) is not np.ndarray or own.base is not None:
                    own = _buffer_owner(v)
                owners[id(own)] = own.nbytes
                continue
            if type(v) is RuntimeStruct and v._acct is not None:  # the producer's accounting
                owners.update(v._acct[1])
                continue
            for arr in (field_arrays(v) if isinstance(v, RuntimeStruct) else (v,)):
                own = _buffer_owner(arr)
                owners[id(own)] = own.nbytes
        buffers = sum(owners.values())
        self._values = types.MappingProxyType(values)
        self._span = None
        c = self._session.counters
        c.add("retained_state_bytes", logical - self._level[0], propagate=False)
        c.add("retained_state_buffer_bytes", buffers - self._level[1], propagate=False)
        self._level[0], self._level[1] = logical, buffers

    def _enter(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise StateError(f"State.{what}: another call is in progress on this state")
        if self._closed:
            self._lock.release()
            raise StateError(f"State.{what}: the state is closed")

    # -- public API --------------------------------------------------------------------------
    @property
    def session(self) -> InferenceSession:
        """The session the state runs on."""
        return self._session

    @property
    def bindings(self) -> list[tuple[str, str]]:
        """(input_name, output_name) pairs of the root graph's persistent_bindings."""
        return list(self._bindings)

    @property
    def values(self) -> Mapping[str, np.ndarray]:
        """The retained values by input name: read-only views sharing the retained buffers.

        The mapping is a snapshot: a later call publishes a new mapping, it does not change
        this one. Available during a call on another thread (the previous values).

        Raises
        ------
        StateError
            The state is closed.
        """
        if self._closed:
            raise StateError("State.values: the state is closed")
        return self._values

    def run(self, feeds: Mapping[str, Any], *, last_only: Sequence[str] = (),
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one call with ``feeds`` plus the retained values; retain the bound outputs.

        Parameters
        ----------
        feeds : dict
            The non-persistent inputs (e.g. ``{"input_ids": ids}``): numpy arrays or DLPack
            CPU tensors, entered without copies. Values mean what the graph's operators say:
            for a converted LM, ``input_ids`` feed ONNX ``Gather``, so negative ids in
            ``[-vocab, 0)`` count from the end of the vocabulary (``-1`` is ``vocab - 1``);
            :func:`olv_runtime.generate` and the CLI accept only ids in ``[0, vocab)``.
        last_only : sequence of str
            Graph outputs (not bound to state) needed at the last position only, e.g.
            ``("logits",)`` for a prefill whose next token is all that is wanted (as llama.cpp
            computes only the last row unless asked for all). Where such an output comes
            straight from a fused linear step (the converter's lm_head), only its last row is
            computed and the returned array has size 1 on axis -2 (``logits[0, -1]`` is the same
            row); otherwise the output is complete. Retained values are never affected.
        outputs : sequence of str, optional
            The graph outputs to return (default: all). Every output is computed and the bound
            ones are retained either way; naming only unbound ones (``("logits",)``, as
            :func:`olv_runtime.generate` does) spares making the bound outputs' views when
            the state does not need them (:attr:`values` makes them when read).

        Returns
        -------
        dict
            The graph outputs (``outputs``, or all) by name. Bound outputs are read-only views
            of the newly retained arrays (the arrays the kernels produced, not copies).

        Raises
        ------
        StateError
            Closed state; another run/reset/close in progress; a feed naming a retained input.
        InvalidArgument
            Unknown, missing or badly typed/laid-out feed; a kernel failure; an output that
            cannot be retained as its bound input (dtype, rank, fixed dims, layout); an unknown
            name in ``outputs``.
            After any failure (also ``KeyboardInterrupt``) nothing is published: the previous
            values and their buffers stay valid and the state keeps working.

        Notes
        -----
        A call whose feed has the name, dtype, shape and strides of the last call's, made when
        every bound output of that call was an in-place KV append of its own bound input
        (:class:`~olv_runtime.executor.steps.KVAppended`: a steady decode), takes the steady path
        (:meth:`_run_steady`): the same values, counters and rules without the checks whose
        outcome is already known.
        """
        if not self._lock.acquire(blocking=False):
            raise StateError("State.run: another call is in progress on this state")
        try:
            if self._closed:
                raise StateError("State.run: the state is closed")
            sd = self._steady
            if (sd is not None and not last_only and type(feeds) is dict and len(feeds) == 1
                    and (outputs is None or outputs is sd.last_outputs)):
                for name, value in feeds.items():
                    if (name == sd.name and type(value) is np.ndarray and value.dtype == sd.dtype
                            and value.shape == sd.shape and value.strides == sd.strides):
                        return self._run_steady(sd, name, value, outputs)
            want = self._check_outputs(outputs)
            with self._call():
                self._steady = None
                if not isinstance(feeds, Mapping):
                    raise InvalidArgument(
                        f"feeds must be a dict of name -> array, got {type(feeds).__name__}"
                    )
                for name in feeds:
                    if name in self._by_input:
                        raise StateError(
                            f"feed {name!r} would override the retained persistent input "
                            f"{name!r} (bound to output {self._by_input[name].output!r}); "
                            "reset the state to change it"
                        )
                if isinstance(last_only, str):
                    raise InvalidArgument(f"last_only: expected a sequence of output names, "
                                          f"got the string {last_only!r}")
                last = frozenset(last_only)
                if last:
                    bound = {b.output for b in self._resolved}
                    free = [a.name for a in self._session.get_outputs() if a.name not in bound]
                    for name in sorted(last):
                        if name not in free:
                            raise InvalidArgument(
                                f"last_only: expected names of graph outputs not bound to the "
                                f"state ({free}), got {name!r}")
                retained = self._values
                sess = self._session
                # the retained values were checked against their inputs' specs when they were
                # retained (_retain): they enter as they are (no per-binding check per call;
                # feeds naming them were refused above)
                prepared = sess.prepare_feeds(feeds, trusted=retained)
                appended = [] if self._steady_ok else None
                outs = sess.run_env(prepared, last, appended)
                new_values = self._retain_all(outs, "output {!r} retained as next value")
                result = dict(outs)
                for b in self._resolved:
                    result[b.output] = new_values[b.input]
                self._publish(new_values)  # atomic publication
                if appended and not last and len(feeds) == 1:
                    self._steady = self._ticket(feeds, prepared, appended, outputs)
            if want is not None:
                return {n: result[n] for n in want}
            return result
        finally:
            self._lock.release()

    def _check_outputs(self, outputs):
        """``outputs`` as a tuple of graph output names (None: all); InvalidArgument naming an
        unknown one."""
        if outputs is None:
            return None
        if isinstance(outputs, str):
            raise InvalidArgument(f"outputs: expected a sequence of output names, got the "
                                  f"string {outputs!r}")
        names = self._session.output_names
        want = tuple(outputs)
        for n in want:
            if n not in names:
                raise InvalidArgument(f"outputs: unknown output {n!r}; the graph outputs are "
                                      f"{list(names)}")
        return want

    def _ticket(self, feeds, prepared, appended, outputs):
        """The :class:`_Steady` call that may follow this one, or None. Its conditions: one
        feed, a numpy array taken as it is; every bound output made by one in-place KV append
        (:class:`~olv_runtime.executor.steps.KVAppended`) of its own bound input; the state's bindings
        eligible (:func:`_steady_eligible`)."""
        if len(appended) != 1:
            return None
        pairs = appended[0]
        if set(pairs) != {(b.output, b.input) for b in self._resolved}:
            return None
        for name, value in feeds.items():
            if type(value) is not np.ndarray or prepared.get(name) is not value:
                return None
            per_pos = 0
            for v in self._values.values():
                per_pos += v.itemsize * (v.size // v.shape[2] if v.shape[2] else
                                         int(np.prod(v.shape[:2] + v.shape[3:])))
            io = tuple((b.input, b.output) for b in self._resolved)
            prog = self._session.decode_program()
            if prog is not None and (prog.pairs is not pairs or prog.feed != name):
                prog = None
            order = None
            if prog is not None:  # binding order -> the program's KV order
                where = {n: j for j, n in enumerate(prog.kv_inputs)}
                order = tuple((b.input, where[b.input]) for b in self._resolved)
            return _Steady(name, value.dtype, value.shape, value.strides, pairs, io, per_pos,
                           prog, order, outputs)
        return None

    def _run_steady(self, sd: "_Steady", name: str, value: np.ndarray, outputs) -> dict:
        """One call of the steady form (:class:`_Steady`; the caller holds the lock): the feed
        has the name, dtype, shape and strides of the last call's checked feed and the retained
        values are the outputs of that call's in-place KV append, so the checks of the generic
        path hold without being run again (feed: the same outcome as the last call's check;
        retained values: checked when retained; symbolic dimensions: every bound input grew by
        one position on the axis whose dimension only they share, :func:`_steady_eligible`).

        With the session's :class:`~olv_runtime.executor.session.DecodeProgram` the token runs there and
        the retained values are the :class:`~olv_runtime.executor.decoder_step.KVSpan` it returns (their
        views made when read, :class:`_SpanValues`). Otherwise the executor runs the plan and the
        outputs are retained without a check when the plan appended in place again (the same
        ``(output, input)`` pairs), else through the generic checks (:meth:`_retain_all`; the
        next call then takes the generic path). Counters, atomic publication and the failure
        rules are those of the generic path."""
        with self._call():
            self._steady = None
            prog = sd.program
            if prog is not None:
                span = self._span
                kv = span if span is not None else [self._values[n] for n in prog.kv_inputs]
                res = prog.run(value, kv)
                if res is not None:
                    logits, span = res
                    self._values = _SpanValues(sd.order, span)  # atomic publication
                    self._span = span
                    self._level[0] += sd.per_pos  # one position more per value, same buffers
                    self._session.counters.add("retained_state_bytes", sd.per_pos,
                                               propagate=False)
                    self._steady = sd
                    if outputs is not None and len(outputs) == 1 and outputs[0] == prog.logits:
                        return {prog.logits: logits}
                    full = dict(zip(prog.kv_outputs, span.views()))
                    full[prog.logits] = logits
                    names = self._session.output_names if outputs is None else outputs
                    return {n: full[n] for n in names}
            prepared = dict(self._values)
            prepared[name] = value
            appended = []
            outs = self._session.run_env(prepared, _NO_NAMES, appended)
            if len(appended) == 1 and appended[0] is sd.pairs:
                new_values = {i: outs[o] for i, o in sd.io}
                self._values = types.MappingProxyType(new_values)  # atomic publication
                self._span = None
                self._level[0] += sd.per_pos  # one position more per value, same buffers
                self._session.counters.add("retained_state_bytes", sd.per_pos, propagate=False)
                self._steady = sd
            else:
                new_values = self._retain_all(outs, "output {!r} retained as next value")
                for b in self._resolved:
                    outs[b.output] = new_values[b.input]
                self._publish(new_values)
            if outputs is not None:
                return {n: outs[n] for n in outputs}
            return outs

    def reset(self, initial: Mapping[str, Any]) -> None:
        """Replace the retained values with caller-supplied initial values.

        The new values are validated first (same rules as :func:`make_state`); on an error the
        previous values stay retained. Views handed out earlier stay valid.

        Raises
        ------
        StateError
            Closed; a call in progress; a missing initial value.
        InvalidArgument
            An unbound name, a value of the wrong type/rank/layout.
        """
        self._enter("reset")
        try:
            with self._call():
                self._steady = None
                self._publish(self._check_initial(initial, "reset"))
                self.tokens, self.cached_tokens, self.rng = [], 0, None
        finally:
            self._lock.release()

    def close(self) -> None:
        """Release the retained values (idempotent). Views handed out earlier stay valid.

        Raises
        ------
        StateError
            A call is in progress on this state.
        """
        if not self._lock.acquire(blocking=False):
            raise StateError("State.close: another call is in progress on this state")
        try:
            if not self._closed:
                self._steady = None
                self._span = None
                self._values = types.MappingProxyType({})
                self._closed = True
                _release_level(self._session.counters, self._level)
        finally:
            self._lock.release()

    def save(self, path):
        """Write the KV cache and token bookkeeping to a file (a prompt cache); see
        :func:`olv_runtime.state.files.save_state`."""
        return files.save_state(self, path)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def __enter__(self) -> "State":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"{len(self._values)} retained values"
        return f"State({status}, bindings={self._bindings})"


def make_state(model, initial: Mapping[str, Any], options: StateOptions | None = None) -> State:
    """Bind a request-local state to a model's persistent bindings (seed 000 ``make_state``).

    The bindings and types are resolved once here; the model is not serialized, cloned or
    compared (neither here nor in later calls).

    Parameters
    ----------
    model : Model, ModelProto, path or InferenceSession
        The model (an existing session is reused as is, so several states can share it).
    initial : dict
        Initial value for every bound input (e.g. :func:`empty_cache`): numpy arrays or DLPack
        CPU tensors (torch). They are retained, not copied.
    options : StateOptions, optional

    Returns
    -------
    State

    Raises
    ------
    BindingError
        Invalid bindings (see :func:`resolve_bindings`).
    StateError
        A bound input has no initial value.
    InvalidArgument
        An initial value of the wrong type/rank/layout (byte-swapped, or non-contiguous where
        a kernel needs contiguous), or for an unbound name.
    """
    options = options or StateOptions()
    with recording() as rec:
        if isinstance(model, InferenceSession):
            session = model
        else:
            session = InferenceSession(as_model(model), options.session_options)
        bindings = resolve_bindings(session.model)
        state = State(session, bindings, initial)
    rec.set("retained_state_bytes", state._level[0], propagate=False)
    rec.set("retained_state_buffer_bytes", state._level[1], propagate=False)
    state.construction_counters = rec.snapshot()
    state.last_counters = dict(state.construction_counters)
    state.counters = Counters()
    state.counters.merge(state.construction_counters)
    return state


def empty_cache(model, batch_size: int = 1) -> dict[str, np.ndarray]:
    """Initial values for every persistently bound input: an empty KV cache.

    Each bound input's declared tensor shape is instantiated with dim 0 = ``batch_size`` when
    symbolic, every other symbolic dim = 0 (the empty sequence), fixed dims as declared.

    Parameters
    ----------
    model : Model, ModelProto, path or InferenceSession
    batch_size : int

    Returns
    -------
    dict
        Input name → zero-size numpy array of the declared element type.

    Raises
    ------
    BindingError
        A bound input that is not a tensor with a declared shape.
    InvalidArgument
        ``batch_size`` not an integer >= 1.
    """
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise InvalidArgument(f"empty_cache: batch_size must be an integer >= 1, got "
                              f"{batch_size!r}")
    session = model if isinstance(model, InferenceSession) else None
    m = session.model if session else as_model(model)
    bindings = resolve_bindings(m)
    infos = {vi.name: vi for vi in m.proto.graph.input}
    out = {}
    for inp, _ in bindings:
        vi = infos[inp]
        if vi.type.WhichOneof("value") == "struct_type":
            # a whole struct cache (e.g. the paged KV cache): empty sequences, zero lengths
            out[inp] = empty_value(vi.type, _resolve(m).catalogue, batch_size)
            continue
        shape = declared_shape(vi)
        if shape is None:
            raise BindingError(f"bound input {inp!r} has no declared tensor shape; build its initial value by hand")
        dims = [d if isinstance(d, int) else (batch_size if k == 0 else 0) for k, d in enumerate(shape)]
        out[inp] = np.zeros(dims, NP_DTYPE[vi.type.tensor_type.elem_type].newbyteorder("="))
    return out
