"""olv_runtime: a numba CPU runtime for quantized LLM decode on ONNX models with encoded
(quantized) values and graph-declared persistent state (seed 000 wire contract).

Main entry points::

    model = olv_runtime.load("out.onnx")
    sess = olv_runtime.InferenceSession(model)
    state = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    out = state.run({"input_ids": ids})
    ids = olv_runtime.generate(model, prompt_ids, max_new_tokens=64)
    res = olv_runtime.generate_result(model, prompt_ids, olv_runtime.GenerationConfig(64))
    olv_runtime.compile_model("out.onnx", "fast.onnx")   # persist prepacked weights (seed 004)
"""
import time as _time

#: ``time.perf_counter()`` when ``import olv_runtime`` started (the CLI reports the time from it
#: to the first generated token: the cold-start figure of bench/cold_start.py).
IMPORT_TIME = _time.perf_counter()

from olv_runtime.decoding import decode_value, to_decoded  # noqa: F401
from olv_runtime.errors import (  # noqa: F401,E402  (the exceptions the README names)
    BindingError,
    CompiledTensorError,
    ContextLengthError,
    ConversionError,
    EncodingError,
    EnvironmentVariableError,
    GGUFFormatError,
    InvalidArgument,
    ModelFormatError,
    OlvError,
    OutputError,
    PayloadError,
    SidecarError,
    StateError,
    StateFileError,
    UnsupportedOperatorError,
    ValidationError,
)
from olv_runtime.engine import Engine, EngineStats, RequestOutput, RequestResult  # noqa: F401
from olv_runtime.executor.session import InferenceSession, NodeArg, SessionOptions  # noqa: F401
from olv_runtime.generation.generate import (  # noqa: F401
    GenerationResult,
    GenerationStats,
    TextStream,
    decode_step,
    eos_token_ids,
    generate,
    generate_result,
    prefill,
    sample_token,
)
from olv_runtime.generation.sampling import SamplingParams, TokenLogprob  # noqa: F401
from olv_runtime.generation.settings import GenerationConfig  # noqa: F401
from olv_runtime.io import Model, load, save  # noqa: F401
from olv_runtime.lazy import lazy_module  # noqa: E402
from olv_runtime.state import State, StateOptions, empty_cache, make_state  # noqa: F401
from olv_runtime.structs.runtime import RuntimeStruct  # noqa: F401

__version__ = "0.1.0"

# modules a decode does not need, imported at their first use (warm start, issue 14)
_compile = lazy_module("olv_runtime.models.compile")
_hf = lazy_module("olv_runtime.models.hf")
_files = lazy_module("olv_runtime.state.files")
_restore = lazy_module("olv_runtime.state.restore")


def compile_model(model, out_path, **kwargs):
    """Persist the prepacked weights of ``model`` for this CPU (seed 004 compiled entries).

    See :func:`olv_runtime.models.compile.compile_model` (``olv compile``).
    """
    return _compile.compile_model(model, out_path, **kwargs)


def convert(checkpoint_dir, out_path, weights: str = "int4-block32", **kwargs):
    """Convert a Hugging Face Qwen2/Qwen3/Llama checkpoint directory, or a GGUF file (tensors
    referenced in place, docs/gguf.md), to an olv ONNX model.

    See :func:`olv_runtime.models.hf.convert` and :func:`olv_runtime.models.gguf.convert_gguf`.
    """
    return _hf.convert(checkpoint_dir, out_path, weights=weights, **kwargs)


def save_state(state, path):
    """Write a state's KV cache and token bookkeeping to ``path`` (``.npz``); see
    :func:`olv_runtime.state.files.save_state`."""
    return _files.save_state(state, path)


def load_state(model, path):
    """A :class:`State` restored from a file written by :func:`save_state`; see
    :func:`olv_runtime.state.restore.load_state`."""
    return _restore.load_state(model, path)


def model_digest(model) -> str:
    """SHA-256 (hex) of a model's content; see :func:`olv_runtime.state.files.model_digest`."""
    return _files.model_digest(model)
