"""What the ``olv`` commands share: the usage error, argument types, session options and the
model's tokenizer."""
from __future__ import annotations

import argparse

from olv_runtime.executor.session import SessionOptions
from olv_runtime.io.sidecars import load_tokenizer


class CliError(Exception):
    """A bad command-line argument: printed as ``olv COMMAND: error: ...``, exit status 2."""


def _tokenizer_for(model):
    """The model's tokenizer (a Model or path): tokenizer.json beside it, checked against the
    digest recorded at conversion and the model's vocabulary (olv_runtime.io.sidecars); None when
    absent. SidecarError (an OlvError: a one-line message) when it belongs to another model or
    cannot be read."""
    return load_tokenizer(model)


def _session_options(args):
    return SessionOptions(num_threads=args.threads,
                          quantize_activations=getattr(args, "quantize_activations", False))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive(text: str) -> int:
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _non_negative(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v
