"""Persistent state from model inputs and outputs (seed 000 "Persistent state from model inputs
and outputs", "Minimal rules", "Zero-copy ownership from the first state implementation").

``make_state(model, initial)`` resolves ``graph.persistent_bindings`` once; ``State.run(feeds)``
runs the graph with the retained values as the bound inputs and retains the bound outputs
themselves (no copy) for the next call, publishing them only after the call succeeded.
``empty_cache(model)`` builds the initial values of a converted model (an empty KV cache).
:mod:`olv_runtime.state.kv` manages contiguous KV capacity buffers (in-place append).
"""
from __future__ import annotations

__all__ = ["State", "StateOptions", "empty_cache", "make_state", "resolve_bindings"]


def __getattr__(name):  # lazy: the session imports state.kv, state.state imports the session
    if name in __all__:
        from olv_runtime.state import state as _state

        return getattr(_state, name)
    raise AttributeError(f"module 'olv_runtime.state' has no attribute {name!r}")
