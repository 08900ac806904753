"""Modules imported on first use, declared at the top of the module that uses them.

Warm start (issue 14: ``import olv_runtime`` -> load -> session -> first token in about a second)
needs some of the package's own modules to stay unimported until a model uses them: the compiled
decode step's kernels until the first decode step, the GGUF block types, the zero-point and paged
kernels, the converters and the graph builder. Instead of an ``import`` inside a function, which
hides the dependency from readers and tools, a module declares it at its top::

    decoder_layers = lazy_module("olv_runtime.kernels.decoder_layers")

and uses ``decoder_layers.X`` as usual; the module is imported at the first attribute access.
``tests/test_architecture.py`` reads these declarations as import edges: they must point down the
layers like any import and take part in the cycle check.

Third-party packages that only some features need (torch, transformers, onnx, jinja2, ...) are
imported inside the functions that need them; :data:`olv_runtime.config.LAZY_IMPORTS` lists them.
"""
from __future__ import annotations

import importlib
import sys

__all__ = ["lazy_module", "import_now"]


class _LazyModule:
    """Attribute access imports the named module (once) and reads from it; nothing is cached on
    the proxy, so a patched attribute of the module is seen at once."""

    __slots__ = ("_olv_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_olv_name", name)

    def __getattr__(self, attr: str):
        module = sys.modules.get(self._olv_name)
        if module is None:
            module = importlib.import_module(self._olv_name)
        return getattr(module, attr)

    def __setattr__(self, attr: str, value) -> None:
        setattr(importlib.import_module(self._olv_name), attr, value)

    def __repr__(self) -> str:
        state = "imported" if self._olv_name in sys.modules else "not imported yet"
        return f"<lazy module {self._olv_name!r} ({state})>"


def lazy_module(name: str):
    """A stand-in for module ``name`` that imports it at the first attribute access.

    Parameters
    ----------
    name : str
        Absolute module name (``"olv_runtime.kernels.decoder_layers"``).

    Returns
    -------
    object
        The module itself when it is already imported, else a proxy whose attributes are the
        module's (``ImportError`` at the first access if it cannot be imported).
    """
    module = sys.modules.get(name)
    return module if module is not None else _LazyModule(name)


def import_now(module):
    """The module behind a :func:`lazy_module` stand-in, imported now (or ``module`` itself when
    it is a module already): for a caller that times the first import, or that keeps the module
    in a hot path."""
    if isinstance(module, _LazyModule):
        return importlib.import_module(module._olv_name)
    return module
