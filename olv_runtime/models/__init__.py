"""Model converters: Hugging Face checkpoints → olv_runtime ONNX graphs.

:mod:`olv_runtime.models.checkpoint` reads a checkpoint directory (config.json + safetensors)
without torch; :mod:`olv_runtime.models.qwen` builds the graph of ``docs/qwen_graph.md``.

The names below are imported on first use (PEP 562): loading a model imports
:mod:`olv_runtime.models.genai` (the onnxruntime-genai folder check), which must not pull in the
converters, the graph builder and ``onnx`` (warm start, issue 14).
"""
import importlib
import importlib.util

_LAZY = {
    "Checkpoint": "olv_runtime.models.checkpoint",
    "load_checkpoint": "olv_runtime.models.checkpoint",
    "SUPPORTED_ARCHITECTURES": "olv_runtime.models.qwen",
    "build_model": "olv_runtime.models.qwen",
    "convert": "olv_runtime.models.qwen",
}

__all__ = ["Checkpoint", "load_checkpoint", "convert", "build_model", "SUPPORTED_ARCHITECTURES"]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")  # a submodule (models.qwen, ...)
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
