"""Sidecar files of a converted model: ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json`` (and ``chat_template.jinja``) beside the ``.onnx`` file.

Sidecars belong to the folder, not to the model file, so two models converted into one folder
would share (and overwrite) them. The converter therefore records each sidecar's SHA-256 in the
model's metadata (``olv.sidecar.<file name>.sha256``) and the list of sidecars it wrote
(``olv.sidecars``); :func:`sidecar_path` hands out a sidecar only if it is the one recorded for
this model, and :func:`load_tokenizer` also checks the tokenizer's vocabulary against the
model's ``olv.vocab_size``. Models converted before this existed carry no record: their sidecars
are used as found (the vocabulary check still applies).
"""
from __future__ import annotations

import hashlib
import pathlib

from olv_runtime.errors import OutputError, SidecarError
from olv_runtime.io import SIDECAR_FILES, Model, load  # noqa: F401  (SIDECAR_FILES re-exported)
from olv_runtime.proto import ModelProto

_LIST_KEY = "olv.sidecars"


def _digest_key(name: str) -> str:
    return f"olv.sidecar.{name}.sha256"


def record(model_proto, files: dict[str, bytes]) -> None:
    """Record the sidecars written with a model in its ``metadata_props`` (in place).

    Parameters
    ----------
    model_proto : ModelProto
    files : dict
        File name -> the exact bytes written beside the model.
    """
    keep = [(p.key, p.value) for p in model_proto.metadata_props
            if p.key != _LIST_KEY and not p.key.startswith("olv.sidecar.")]
    del model_proto.metadata_props[:]
    for k, v in keep:
        model_proto.metadata_props.add(key=k, value=v)
    model_proto.metadata_props.add(key=_LIST_KEY, value=",".join(sorted(files)))
    for name, data in sorted(files.items()):
        model_proto.metadata_props.add(key=_digest_key(name),
                                       value=hashlib.sha256(data).hexdigest())


def check_replacements(out_path, files: dict[str, bytes]) -> None:
    """Refuse to replace a sidecar that another model in the same folder records.

    Called by the converters before anything is written: writing ``files`` beside ``out_path``
    would otherwise replace ``tokenizer.json`` (or another sidecar) of a model converted into the
    same folder earlier, and that model's text prompts would then fail with a
    :class:`SidecarError`.

    Parameters
    ----------
    out_path : pathlib.Path
        The ``.onnx`` file about to be written (a model already at this path is being replaced
        and does not count).
    files : dict
        Sidecar file name -> the bytes about to be written.

    Raises
    ------
    OutputError
        An existing sidecar differs from the bytes to write and another ``.onnx`` file in the
        folder records its SHA-256 (``olv.sidecar.<name>.sha256``); names both files.
    """
    folder = pathlib.Path(out_path).parent
    changed = {}
    for name, data in files.items():
        dst = folder / name
        if dst.is_file():
            old = dst.read_bytes()
            if old != data:
                changed[name] = hashlib.sha256(old).hexdigest()
    if not changed:
        return
    for other in sorted(folder.glob("*.onnx")):
        if other.resolve() == pathlib.Path(out_path).resolve() or not other.is_file():
            continue
        try:
            meta = {p.key: p.value for p in ModelProto.FromString(other.read_bytes()).metadata_props}
        except Exception:  # not a model we can read: it records nothing
            continue
        for name, digest in changed.items():
            if meta.get(_digest_key(name)) == digest:
                raise OutputError(
                    f"converting into {str(folder)!r} would replace {name} of {other.name} "
                    f"(another model in that folder, which records this file's SHA-256); "
                    f"convert into another folder, or remove {other.name} first"
                )


def _model_and_dir(model):
    if hasattr(model, "model") and isinstance(getattr(model, "model"), Model):  # a session
        model = model.model
    if isinstance(model, (str, pathlib.Path)):
        model = load(model)
    if not isinstance(model, Model) or model.path is None:
        return None, None
    return model, model.path.parent


def sidecar_path(model, name: str) -> pathlib.Path | None:
    """The sidecar ``name`` of ``model`` (a Model, InferenceSession or path), or None.

    Returns None when the file is absent, or when the model records its sidecars and ``name``
    is not among them (a file another model left in the folder).

    Raises
    ------
    SidecarError
        The file's SHA-256 differs from the one recorded at conversion: it belongs to another
        model converted into the same folder (or was edited).
    """
    m, folder = _model_and_dir(model)
    if m is None:
        return None
    path = folder / name
    if not path.is_file():
        return None
    meta = m.metadata()
    if _LIST_KEY not in meta:
        return path  # converted before sidecars were recorded
    if name not in meta[_LIST_KEY].split(","):
        return None
    want = meta.get(_digest_key(name))
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if want is not None and want != got:
        raise SidecarError(
            f"{path} does not belong to {m.path.name}: its SHA-256 {got[:12]}... differs from "
            f"the {want[:12]}... recorded when the model was converted (another model converted "
            f"into {folder} replaced it?); reconvert the model into its own folder"
        )
    return path


def load_tokenizer(model):
    """The ``tokenizers.Tokenizer`` of a model (None without tokenizer.json).

    Raises
    ------
    SidecarError
        tokenizer.json of another model (see :func:`sidecar_path`), unreadable, or with more
        tokens than the model's vocabulary (``olv.vocab_size``).
    """
    path = sidecar_path(model, "tokenizer.json")
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type
        raise SidecarError(f"{path} cannot be read as a tokenizer: {exc}") from None
    m, _ = _model_and_dir(model)
    vocab = m.metadata().get("olv.vocab_size") if m is not None else None
    if vocab is not None and vocab.isdigit():
        n = tok.get_vocab_size(with_added_tokens=True)
        if n > int(vocab):
            raise SidecarError(
                f"{path} has {n} tokens but the model's vocabulary is {vocab} "
                f"(olv.vocab_size): the tokenizer belongs to another model"
            )
    return tok
