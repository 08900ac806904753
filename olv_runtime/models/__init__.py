"""Model converters: Hugging Face checkpoints → olv_runtime ONNX graphs.

:mod:`olv_runtime.models.checkpoint` reads a checkpoint directory (config.json + safetensors)
without torch; :mod:`olv_runtime.models.qwen` builds the graph of ``docs/qwen_graph.md``.
"""
from olv_runtime.models.checkpoint import Checkpoint, load_checkpoint
from olv_runtime.models.qwen import SUPPORTED_ARCHITECTURES, build_model, convert

__all__ = ["Checkpoint", "load_checkpoint", "convert", "build_model", "SUPPORTED_ARCHITECTURES"]
