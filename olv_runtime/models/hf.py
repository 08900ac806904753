"""Convert a Qwen2 / Qwen3 / Llama Hugging Face checkpoint (or a GGUF file) to an olv_runtime
ONNX model: :func:`convert` (``olv convert``).

The graph is built by :func:`olv_runtime.models.qwen_graph.build_model` (``docs/qwen_graph.md``);
a ``.gguf`` file is handed to :func:`olv_runtime.models.gguf.convert_gguf`. The output and its
sidecar files (tokenizer, generation config) are checked before anything is written.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from collections.abc import Callable

from olv_runtime.errors import ConversionError, OutputError
from olv_runtime.io import _payload_messages, same_file, save
from olv_runtime.io.sidecars import SIDECAR_FILES
from olv_runtime.io.sidecars import check_replacements as check_sidecar_replacements
from olv_runtime.io.sidecars import record as record_sidecars
from olv_runtime.models.checkpoint import Checkpoint
from olv_runtime.models.gguf import convert_gguf
from olv_runtime.models.qwen_graph import (  # noqa: F401  (re-exported: the converter's names)
    BLOCK_SIZE,
    SCALE_DTYPES,
    SUPPORTED_ARCHITECTURES,
    TOKENIZER_FILES,
    WEIGHT_FORMATS,
    QwenConfig,
    build_model,
    compute_inv_freq,
)
from olv_runtime.proto import ModelProto

__all__ = ["convert", "ConversionResult", "ConversionWarning", "check_output_path"]


@dataclasses.dataclass(frozen=True, repr=False)
class ConversionResult:
    """What :func:`convert` wrote (a short repr: printing it in a REPL shows no weights).

    Attributes
    ----------
    path : pathlib.Path
        The model file.
    data_path : pathlib.Path or None
        Its external data file (None when every payload is inline or stays in a GGUF file).
    nbytes : int
        Bytes written: model file + external data file.
    architecture, weights : str
    num_layers, vocab_size : int
    unused_tensors : tuple of str
        Checkpoint tensors the graph does not use.
    proto : ModelProto
        The model written (``graph`` is a shortcut for ``proto.graph``).
    """

    path: pathlib.Path
    data_path: pathlib.Path | None
    nbytes: int
    architecture: str
    weights: str
    num_layers: int
    vocab_size: int
    unused_tensors: tuple
    proto: ModelProto

    @property
    def graph(self):
        return self.proto.graph

    def metadata(self) -> dict[str, str]:
        return {e.key: e.value for e in self.proto.metadata_props}

    def __repr__(self) -> str:
        unused = f", {len(self.unused_tensors)} unused tensors" if self.unused_tensors else ""
        return (f"ConversionResult(path={str(self.path)!r}, {self.nbytes / 1e6:.1f} MB, "
                f"{self.architecture}, {self.num_layers} layers, vocab {self.vocab_size}, "
                f"weights {self.weights}{unused})")


def _checkpoint_inputs(source: pathlib.Path) -> list[pathlib.Path]:
    """The files a conversion reads: a GGUF file, or the checkpoint directory's config,
    safetensors, index and sidecar files."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        return []
    names = set(TOKENIZER_FILES) | set(SIDECAR_FILES) | {"config.json"}
    return [f for f in source.iterdir()
            if f.is_file() and (f.name in names or f.name.endswith(".safetensors")
                                or f.name.endswith(".safetensors.index.json"))]


def check_output_path(out_path, inputs=(), what: str = "output") -> pathlib.Path:
    """Refuse an output path that cannot or must not be written, before any work is done.

    Parameters
    ----------
    out_path : path-like
        The model file to write (its ``.data`` file beside it is checked too).
    inputs : iterable of path-like
        Files the same call reads: none of them may be overwritten.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    OutputError
        An existing directory, a non-regular file, one of ``inputs`` (or its ``.data`` file
        is), or a location whose nearest existing parent is not a writable directory.
    """
    out = pathlib.Path(out_path)
    if out.is_dir():
        raise OutputError(
            f"{what} {str(out)!r} is an existing directory; pass a file path such as "
            f"{str(out / 'model.onnx')!r}"
        )
    if out.exists() and not out.is_file():
        raise OutputError(f"{what} {str(out)!r} exists and is not a regular file")
    targets = [out, out.with_name(out.name + ".data")]
    for src in inputs:
        src = pathlib.Path(src)
        for t in targets:
            if same_file(t, src):
                raise OutputError(
                    f"{what} {str(t)!r} is an input of this conversion ({str(src)!r}); "
                    "refusing to overwrite it (choose another output path)"
                )
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(
            f"cannot write {what} {str(out)!r}: {str(parent)!r} is not a directory"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(
            f"cannot write {what} {str(out)!r}: {str(parent)!r} is not a writable directory"
        )
    return out


def convert(checkpoint_dir, out_path, weights: str = "int4-block32", *,
            progress: Callable[[str], None] | None = None,
            external_data: bool | None = None, kv: str = "contiguous",
            scale_dtype: str = "float16") -> ConversionResult:
    """Convert a checkpoint directory (or a GGUF file) to an ONNX file.

    A file path is a GGUF file: :func:`olv_runtime.models.gguf.convert_gguf` (tensors referenced
    in place; ``weights`` and ``external_data`` do not apply). Otherwise writes the model of
    :func:`build_model` to ``out_path`` with :func:`olv_runtime.io.save` and copies
    ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json`` and
    ``chat_template.jinja`` from the checkpoint directory next to it when present, recording
    their SHA-256 in the model's metadata (:mod:`olv_runtime.io.sidecars`: a sidecar later
    replaced by another model's is refused, not silently used).

    Parameters
    ----------
    checkpoint_dir : str or os.PathLike
        Hugging Face checkpoint directory (config.json + safetensors), or a ``.gguf`` file.
    out_path : str or os.PathLike
        Output ``.onnx`` path; its directory is created if needed.
    weights : {"int4-block32", "float32"}
        Weight format.
    progress : callable, optional
        ``progress(msg)`` called per layer (and with the list of unused checkpoint tensors).
    external_data : bool, optional
        Passed to :func:`olv_runtime.io.save` (None: external data only above 256 MiB).
    kv : str
        KV cache kind, see :func:`build_model`.
    scale_dtype : {"float16", "float32"}
        INT4 block-scale type, see :func:`build_model`.

    Returns
    -------
    ConversionResult
        Path, bytes written, summary and the unused checkpoint tensors (``.proto``: the model).

    Raises
    ------
    ConversionError
        See :func:`build_model` (a tensor the architecture requires is missing, ...).
    OutputError
        ``out_path`` is an existing directory, an input file (or its .data file is), or not
        writable. Nothing is written then.
    """
    source = pathlib.Path(os.fspath(checkpoint_dir))
    out = check_output_path(out_path, _checkpoint_inputs(source))
    if source.is_file():  # a GGUF file (models/gguf.py)
        if source.suffix.lower() != ".gguf":
            raise ConversionError(
                f"{str(source)!r} is a file, not a checkpoint directory (pass the directory that "
                "holds config.json and the *.safetensors files, or a .gguf file)"
            )
        model = convert_gguf(source, out, progress=progress)
        return _result(out, model, (), None)
    unused = []
    with Checkpoint(source) as ckpt:
        model = build_model(ckpt, weights, progress=progress, kv=kv,
                            scale_dtype=scale_dtype, unused=unused)
    files = {}
    for fname in SIDECAR_FILES:
        src = source / fname
        if src.is_file():
            files[fname] = src.read_bytes()
    record_sidecars(model, files)
    check_sidecar_replacements(out, files)
    if progress:
        progress(f"writing {out}")
    save(model, out, external_data=external_data)
    for fname, data in files.items():
        dst = out.parent / fname
        if dst.exists() and os.path.samefile(dst, source / fname):
            continue
        try:
            dst.write_bytes(data)
        except OSError as exc:
            raise OutputError(f"cannot write {str(dst)!r}: {exc.strerror}") from None
    if unused:
        warnings.warn(
            f"{len(unused)} checkpoint tensors are not used by the {model.graph.name or 'model'} "
            f"graph: {', '.join(unused[:10])}{' ...' if len(unused) > 10 else ''}",
            ConversionWarning, stacklevel=2)
    return _result(out, model, unused, weights)


class ConversionWarning(UserWarning):
    """A conversion succeeded but something was ignored (unused checkpoint tensors)."""


def _result(out: pathlib.Path, model: ModelProto, unused, weights) -> ConversionResult:
    meta = {e.key: e.value for e in model.metadata_props}
    data = out.with_name(out.name + ".data")
    # what the written file references (``model`` may be the in-memory message, whose float32
    # initializers save() externalized in a copy: it then names no data file)
    written = model
    if data.is_file():
        written = ModelProto.FromString(out.read_bytes())
    has_data = data.is_file() and any(
        e.value == data.name for m in _payload_messages(written)
        for e in m.external_data if e.key == "location")
    size = out.stat().st_size + (data.stat().st_size if has_data else 0)

    def num(key):
        v = meta.get(key, "0")
        return int(v) if v.isdigit() else 0

    return ConversionResult(out, data if has_data else None, size,
                            meta.get("olv.architecture", ""), weights or meta.get("olv.weights", ""),
                            num("olv.num_layers"), num("olv.vocab_size"), tuple(unused), model)
