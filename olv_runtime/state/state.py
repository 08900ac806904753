"""Request-local persistent state bound by ``GraphProto.persistent_bindings`` (seed 000 PR04).

Equivalent to the stateless loop of seed 000::

    feeds = {"input_ids": ids, **state.values}
    outputs = run(model, feeds)
    state.values = {inp: outputs[out] for inp, out in bindings}

but the retained values are the output arrays themselves (zero payload copies), published
atomically after a successful call, and guarded against concurrent use.
"""
from __future__ import annotations

import dataclasses
import threading
import types
from typing import Any, Mapping

import numpy as np

from olv_runtime.errors import BindingError, InvalidArgument, StateError
from olv_runtime.io import Model, as_model
from olv_runtime.proto import TensorProto
from olv_runtime.session import InferenceSession, SessionOptions, _shape_of, check_tensor


@dataclasses.dataclass
class StateOptions:
    """Options of :func:`make_state`.

    Attributes
    ----------
    session_options : SessionOptions, optional
        Used when ``make_state`` creates the session itself.
    """

    session_options: SessionOptions | None = None


def resolve_bindings(model: Model) -> list[tuple[str, str]]:
    """Validate ``graph.persistent_bindings`` of the root graph; return (input, output) pairs.

    Raises
    ------
    BindingError
        Unknown input/output name, an input that is an initializer, duplicate input or output
        selections, element type or rank mismatch between the pair, string tensors, bindings
        declared inside a control-flow subgraph.
    """
    g = model.proto.graph
    inputs = {vi.name: vi for vi in g.input}
    outputs = {vi.name: vi for vi in g.output}
    inits = {t.name for t in g.initializer} | {e.name for e in g.encoded_initializer}
    _reject_nested_bindings(g)
    pairs: list[tuple[str, str]] = []
    seen_in: set[str] = set()
    seen_out: set[str] = set()
    for b in g.persistent_bindings:
        i, o = b.input_name, b.output_name
        if i not in inputs:
            raise BindingError(f"persistent binding {i!r} <- {o!r}: {i!r} is not a graph input")
        if i in inits:
            raise BindingError(
                f"persistent binding {i!r} <- {o!r}: {i!r} is an initializer, not a free input"
            )
        if o not in outputs:
            raise BindingError(f"persistent binding {i!r} <- {o!r}: {o!r} is not a graph output")
        if i in seen_in:
            raise BindingError(f"input {i!r} is selected by more than one persistent binding")
        if o in seen_out:
            raise BindingError(f"output {o!r} is selected by more than one persistent binding")
        seen_in.add(i)
        seen_out.add(o)
        ti, to = inputs[i].type, outputs[o].type
        if ti.WhichOneof("value") != to.WhichOneof("value"):
            raise BindingError(
                f"persistent binding {i!r} <- {o!r}: input is {ti.WhichOneof('value')}, output is "
                f"{to.WhichOneof('value')}"
            )
        if ti.WhichOneof("value") == "tensor_type":
            ei, eo = ti.tensor_type.elem_type, to.tensor_type.elem_type
            if TensorProto.STRING in (ei, eo):
                raise BindingError(f"persistent binding {i!r} <- {o!r}: string tensors cannot persist")
            if ei != eo:
                raise BindingError(
                    f"persistent binding {i!r} <- {o!r}: element types differ "
                    f"({TensorProto.DataType.Name(ei)} vs {TensorProto.DataType.Name(eo)})"
                )
            si, so = _shape_of(inputs[i]), _shape_of(outputs[o])
            if si is not None and so is not None:
                if len(si) != len(so):
                    raise BindingError(
                        f"persistent binding {i!r} <- {o!r}: ranks differ ({si} vs {so})"
                    )
                for k, (a, c) in enumerate(zip(si, so)):
                    if isinstance(a, int) and isinstance(c, int) and a != c:
                        raise BindingError(
                            f"persistent binding {i!r} <- {o!r}: dimension {k} differs ({a} vs {c})"
                        )
        pairs.append((i, o))
    return pairs


def _reject_nested_bindings(graph) -> None:
    for node in graph.node:
        for attr in node.attribute:
            subs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
            for sub in subs:
                if len(sub.persistent_bindings):
                    raise BindingError(
                        f"node {node.name!r} ({node.op_type}) attribute {attr.name!r}: persistent "
                        "bindings inside control-flow subgraphs are not supported (root graph only)"
                    )
                _reject_nested_bindings(sub)


def _readonly(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr`` (same buffer, no copy)."""
    view = arr.view()
    view.flags.writeable = False
    return view


class State:
    """Request-local state of one model: retained values of the bound inputs.

    Create with :func:`make_state`. Use ``run`` per call, ``values`` for read-only views of the
    retained values, ``reset(initial)`` to start over, ``close()`` to release; usable as a
    context manager.
    """

    def __init__(self, session: InferenceSession, bindings: list[tuple[str, str]],
                 initial: Mapping[str, Any]):
        self._session = session
        self._bindings = bindings
        self._bound_inputs = {i for i, _ in bindings}
        self._lock = threading.Lock()
        self._closed = False
        self._values = self._check_initial(initial)

    # -- helpers ---------------------------------------------------------------------------
    def _check_initial(self, initial: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if not isinstance(initial, Mapping):
            raise InvalidArgument(f"initial must be a dict of input name -> array, got {type(initial).__name__}")
        infos = self._session._input_infos
        values = {}
        for name in initial:
            if name not in self._bound_inputs:
                raise InvalidArgument(
                    f"initial value {name!r} is not a persistently bound input; bound inputs: "
                    f"{sorted(self._bound_inputs)}"
                )
        for name in sorted(self._bound_inputs):
            if name not in initial:
                raise StateError(f"missing initial value for persistent input {name!r}")
            values[name] = _readonly(check_tensor(name, initial[name], infos[name],
                                                  self._session.accepts_strided(name)))
        return values

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
        """Read-only views of the retained values, keyed by input name (shared, not copies)."""
        if self._closed:
            raise StateError("State.values: the state is closed")
        return types.MappingProxyType(dict(self._values))

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run one call with ``feeds`` plus the retained values; retain the bound outputs.

        Parameters
        ----------
        feeds : dict
            The non-persistent inputs (e.g. ``{"input_ids": ids}``).

        Returns
        -------
        dict
            Every graph output by name. Bound outputs are read-only views of the retained arrays.

        Raises
        ------
        StateError
            Closed state, a concurrent call, a feed naming a retained input.
        InvalidArgument
            Unknown/missing/badly typed feed, or a kernel failure. The previous values stay
            retained and valid after any failure.
        """
        self._enter("run")
        try:
            if not isinstance(feeds, Mapping):
                raise InvalidArgument(f"feeds must be a dict of name -> array, got {type(feeds).__name__}")
            for name in feeds:
                if name in self._bound_inputs:
                    raise StateError(
                        f"feed {name!r} would override a retained persistent input; reset the "
                        "state to change it"
                    )
            all_feeds = dict(feeds)
            all_feeds.update(self._values)
            prepared = self._session.prepare_feeds(all_feeds)
            outputs = self._session.run_env(prepared)
            new_values = {}
            infos = self._session._input_infos
            for inp, out in self._bindings:
                new_values[inp] = _readonly(check_tensor(inp, outputs[out], infos[inp],
                                                         self._session.accepts_strided(inp)))
            result = dict(outputs)
            for inp, out in self._bindings:
                result[out] = new_values[inp]
            self._values = new_values  # atomic publication
            return result
        finally:
            self._lock.release()

    def reset(self, initial: Mapping[str, Any]) -> None:
        """Replace the retained values with caller-supplied initial values (validated first)."""
        self._enter("reset")
        try:
            self._values = self._check_initial(initial)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Release the retained values. Views handed out earlier stay valid."""
        self._enter("close")
        try:
            self._values = {}
            self._closed = True
        finally:
            self._lock.release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "State":
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self.close()


def make_state(model, initial: Mapping[str, Any], options: StateOptions | None = None) -> State:
    """Bind a state to a model's persistent bindings (seed 000 ``make_state``).

    Parameters
    ----------
    model : Model, ModelProto, path or InferenceSession
        The model (an existing session is reused as is).
    initial : dict
        Initial value for every bound input (e.g. :func:`empty_cache`). Arrays are retained,
        not copied.
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
        An initial value of the wrong type/rank/layout, or for an unbound name.
    """
    options = options or StateOptions()
    if isinstance(model, InferenceSession):
        session = model
    else:
        session = InferenceSession(as_model(model), options.session_options)
    bindings = resolve_bindings(session.model)
    return State(session, bindings, initial)


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
    """
    session = model if isinstance(model, InferenceSession) else None
    m = session.model if session else as_model(model)
    bindings = resolve_bindings(m)
    infos = {vi.name: vi for vi in m.proto.graph.input}
    from olv_runtime.values import NP_DTYPE

    out = {}
    for inp, _ in bindings:
        vi = infos[inp]
        shape = _shape_of(vi)
        if shape is None:
            raise BindingError(f"bound input {inp!r} has no declared tensor shape; build its initial value by hand")
        dims = [d if isinstance(d, int) else (batch_size if k == 0 else 0) for k, d in enumerate(shape)]
        out[inp] = np.zeros(dims, NP_DTYPE[vi.type.tensor_type.elem_type].newbyteorder("="))
    return out
