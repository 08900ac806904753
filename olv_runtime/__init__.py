"""olv_runtime: a numba CPU runtime for quantized LLM decode on ONNX models with encoded
(quantized) values and graph-declared persistent state (seed 000 wire contract).

Main entry points::

    model = olv_runtime.load("out.onnx")
    sess = olv_runtime.InferenceSession(model)
    state = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    out = state.run({"input_ids": ids})
    ids = olv_runtime.generate(model, prompt_ids, max_new_tokens=64)
    olv_runtime.compile_model("out.onnx", "fast.onnx")   # persist prepacked weights (seed 004)
"""
import time as _time

#: ``time.perf_counter()`` when ``import olv_runtime`` started (the CLI reports the time from it
#: to the first generated token: the cold-start figure of bench/cold_start.py).
IMPORT_TIME = _time.perf_counter()

from olv_runtime.errors import (  # noqa: F401,E402  (the exceptions the README names)
    BindingError, CompiledTensorError, ContextLengthError, ConversionError, EncodingError,
    EnvironmentVariableError,
    GGUFFormatError, InvalidArgument, ModelFormatError, OlvError, OutputError, PayloadError,
    SidecarError, StateError, StateFileError, UnsupportedOperatorError, ValidationError)
from olv_runtime.generate import (  # noqa: F401
    GenerationResult, GenerationStats, TextStream, eos_token_ids, generate, sample_token)
from olv_runtime.sampling import SamplingParams, TokenLogprob  # noqa: F401
from olv_runtime.io import Model, load, save  # noqa: F401
from olv_runtime.session import InferenceSession, NodeArg, SessionOptions  # noqa: F401
from olv_runtime.state import State, StateOptions, empty_cache, make_state  # noqa: F401
from olv_runtime.structs import decode_value, to_decoded  # noqa: F401
from olv_runtime.structs.runtime import RuntimeStruct  # noqa: F401

__version__ = "0.1.0"

#: public names imported on first use (PEP 562): modules a decode does not need (warm start)
_LAZY = {"load_state": "olv_runtime.prompt_cache", "save_state": "olv_runtime.prompt_cache",
         "model_digest": "olv_runtime.prompt_cache"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'olv_runtime' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def compile_model(model, out_path, **kwargs):
    """Persist the prepacked weights of ``model`` for this CPU (seed 004 compiled entries).

    See :func:`olv_runtime.compiled.compile_model` (``olv compile``).
    """
    from olv_runtime.compiled import compile_model as _compile

    return _compile(model, out_path, **kwargs)


def convert(checkpoint_dir, out_path, weights: str = "int4-block32", **kwargs):
    """Convert a Hugging Face Qwen2/Qwen3/Llama checkpoint directory, or a GGUF file (tensors
    referenced in place, docs/gguf.md), to an olv ONNX model.

    See :func:`olv_runtime.models.qwen.convert` and :func:`olv_runtime.models.gguf.convert_gguf`.
    """
    from olv_runtime.models.qwen import convert as _convert

    return _convert(checkpoint_dir, out_path, weights=weights, **kwargs)
