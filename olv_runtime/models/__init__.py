"""Model converters: Hugging Face checkpoints → olv_runtime ONNX graphs.

:mod:`olv_runtime.models.checkpoint` reads a checkpoint directory (config.json + safetensors)
without torch; :mod:`olv_runtime.models.hf` builds the graph of ``docs/qwen_graph.md``.

One importer per source: :mod:`~olv_runtime.models.hf` (Hugging Face checkpoint directories;
``convert`` also dispatches ``.gguf`` files), :mod:`~olv_runtime.models.gguf` (GGUF files, tensors
referenced in place), the shared graph of :mod:`~olv_runtime.models.qwen_graph`, the paged-KV
rewrite :mod:`~olv_runtime.models.paged_kv` and ``olv compile`` (:mod:`~olv_runtime.models.compile`).
onnxruntime-genai folders need no conversion: :mod:`olv_runtime.io.genai` adapts them at load.
Nothing on the decode path imports this package (warm start, issue 14).
"""
from olv_runtime.models import hf  # noqa: F401
from olv_runtime.models.checkpoint import Checkpoint, load_checkpoint  # noqa: F401
from olv_runtime.models.hf import SUPPORTED_ARCHITECTURES, convert  # noqa: F401
from olv_runtime.models.qwen_graph import build_model  # noqa: F401

__all__ = ["Checkpoint", "load_checkpoint", "convert", "build_model", "SUPPORTED_ARCHITECTURES"]
