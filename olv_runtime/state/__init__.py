"""Persistent state from model inputs and outputs (seed 000 "Persistent state from model inputs
and outputs", "Minimal rules", "Zero-copy ownership from the first state implementation").

``make_state(model, initial)`` resolves ``graph.persistent_bindings`` once
(:mod:`olv_runtime.state.bindings`); ``State.run(feeds)`` runs the graph with the retained values as
the bound inputs and retains the bound outputs themselves (no copy) for the next call, publishing
them only after the call succeeded. ``empty_cache(model)`` builds the initial values of a converted
model (an empty KV cache). State files: :mod:`olv_runtime.state.files` (save),
:mod:`olv_runtime.state.restore` (load, prefix reuse). The KV caches themselves are in
:mod:`olv_runtime.kv`.
"""
from __future__ import annotations

from olv_runtime.state.bindings import resolve_bindings
from olv_runtime.state.state import State, StateOptions, empty_cache, make_state

__all__ = ["State", "StateOptions", "empty_cache", "make_state", "resolve_bindings"]
