"""Loading and saving models in the onnx-light wire format (``proto/onnx_light.proto``).

:func:`load` parses a model file into :class:`Model`, which owns the parsed
``ModelProto`` and the read-only memory maps of its external data. Payloads are exposed as
``uint8`` numpy views (:meth:`Model.payload`): inline bytes are viewed in place, external bytes
are slices of a read-only ``mmap``. Loading never runs codec code and never copies payloads.

:func:`save` writes a model, optionally moving large payloads (dense initializers and encoded
initializers) to one external data file beside it (ONNX external-data convention:
``location``/``offset``/``length`` entries, ``data_location = EXTERNAL``).

Source: ONNX IR "External tensor data"; seed 000 "Payload and lifetime contract".
"""
from __future__ import annotations

import mmap
import os
import pathlib
import re
import stat
import tempfile
from typing import Iterator, Union

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from olv_runtime.errors import ModelFormatError, OutputError, PayloadError
from olv_runtime.io.genai import adapt
from olv_runtime.proto import EncodedValueProto, ModelProto, TensorProto

PathLike = Union[str, os.PathLike]

#: Payloads at or above this many bytes go to the external data file when saving externally.
EXTERNAL_THRESHOLD = 1024
#: Serialized models above this size are saved with external data by default (protobuf's hard
#: limit for one message is 2 GiB).
AUTO_EXTERNAL_BYTES = 256 << 20
_ALIGN = 64
#: Files beside a converted model that belong to it (olv_runtime.io.sidecars)
SIDECAR_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja")
_DECIMAL = re.compile(r"[0-9]+")  # ASCII digits only (no sign, spaces, '_' or other scripts)


class Model:
    """A loaded model: the parsed ``ModelProto`` plus the owners of its payload bytes.

    Parameters
    ----------
    proto : ModelProto
        The parsed message (``olv_runtime.proto.ModelProto``). Treated as immutable once a session
        or state is bound to it (seed 000 "Persistent state": the model is immutable).
    path : path-like, optional
        The file it came from; external data locations are resolved relative to its directory.

    Attributes
    ----------
    proto : ModelProto
    path : pathlib.Path or None
    base_dir : pathlib.Path or None
        Directory external data locations are relative to.
    """

    def __init__(self, proto: ModelProto, path: PathLike | None = None):
        if not isinstance(proto, ModelProto):
            raise ModelFormatError(
                f"Model expects an olv_runtime.proto.ModelProto, got {type(proto).__name__}"
            )
        self.proto = proto
        self.path = pathlib.Path(path).resolve() if path is not None else None
        self.base_dir = self.path.parent if self.path is not None else None
        self._maps: dict[pathlib.Path, tuple[mmap.mmap, np.ndarray]] = {}
        self._stamps: dict[pathlib.Path, tuple[int, int, int, int]] = {}  # size, mtime, ino, dev
        self._payloads: dict[tuple[str, str], np.ndarray] = {}
        self._paths: dict[str, pathlib.Path] = {}

    # -- payload access ----------------------------------------------------------------------
    def payload(self, message: TensorProto | EncodedValueProto, key: tuple | None = None
                ) -> np.ndarray:
        """The payload bytes of a dense or encoded initializer, as a read-only ``uint8`` view.

        Parameters
        ----------
        message : TensorProto or EncodedValueProto
            An initializer of this model (``raw_data`` inline or ``data_location = EXTERNAL``),
            or the scale / zero_point TensorProto of an affine encoded initializer.
        key : tuple, optional
            Cache key; default ``("tensor" | "encoded", name)``. Affine parameters use
            ``("scale" | "zero_point", encoded initializer name)``.

        Returns
        -------
        numpy.ndarray
            1-D ``uint8``, length = payload bytes. A view of the inline bytes or of the read-only
            memory map of the external file; never a copy. Cached per value name.

        Raises
        ------
        PayloadError
            raw_data and external_data both set; EXTERNAL without location or length; a location
            that is absolute or escapes the model directory; a range past the end of the file.
        """
        kind = "encoded" if isinstance(message, EncodedValueProto) else "tensor"
        key = key or (kind, message.name)
        cached = self._payloads.get(key)
        if cached is not None:
            return cached
        view = self._resolve_payload(message, kind)
        self._payloads[key] = view
        return view

    def _resolve_payload(self, message, kind: str) -> np.ndarray:
        name = message.name
        is_external = message.data_location == TensorProto.EXTERNAL
        if message.external_data and not is_external:
            raise PayloadError(
                f"{kind} value {name!r}: external_data is set but data_location is not EXTERNAL"
            )
        if not is_external:
            raw = message.raw_data  # one bytes object, kept alive by the returned view
            view = np.frombuffer(raw, dtype=np.uint8) if raw else np.zeros(0, np.uint8)
            view.flags.writeable = False
            return view
        if message.HasField("raw_data"):
            raise PayloadError(
                f"{kind} value {name!r}: raw_data and external_data are mutually exclusive "
                f"(raw_data has {len(message.raw_data)} bytes)"
            )
        entries = {e.key: e.value for e in message.external_data}
        location = entries.get("location")
        if not location:
            raise PayloadError(f"{kind} value {name!r}: EXTERNAL payload without 'location'")
        if "length" not in entries and kind == "encoded":
            raise PayloadError(
                f"{kind} value {name!r}: EXTERNAL payload needs an explicit 'length' (seed 000)"
            )
        offset = _decimal(entries.get("offset", "0"), "offset", kind, name)
        length = _decimal(entries["length"], "length", kind, name) if "length" in entries else None
        file_path = self._external_path(name, kind, location)
        data = self._map(file_path)
        if offset > data.size:
            raise PayloadError(
                f"{kind} value {name!r}: external offset {offset} lies past the end of "
                f"{location!r} ({data.size} bytes)"
            )
        if length is None:
            length = data.size - offset
        if offset + length > data.size:
            raise PayloadError(
                f"{kind} value {name!r}: external range [{offset}, {offset + length}) lies past "
                f"the end of {location!r} ({data.size} bytes)"
            )
        return data[offset : offset + length]

    def _external_path(self, name: str, kind: str, location: str) -> pathlib.Path:
        got = self._paths.get(location)  # resolved once per location (hundreds of values)
        if got is not None:
            return got
        full = self._check_external_path(name, kind, location)
        self._paths[location] = full
        return full

    def _check_external_path(self, name: str, kind: str, location: str) -> pathlib.Path:
        if self.base_dir is None:
            raise PayloadError(
                f"{kind} value {name!r} has external data {location!r} but the model was not "
                "loaded from a file (no directory to resolve it against)"
            )
        if "\0" in location:
            raise PayloadError(
                f"{kind} value {name!r}: external location {location!r} contains a NUL byte"
            )
        rel = pathlib.PurePosixPath(location.replace("\\", "/"))
        if rel.is_absolute() or pathlib.Path(location).is_absolute():
            raise PayloadError(
                f"{kind} value {name!r}: external location {location!r} must be relative"
            )
        try:
            full = (self.base_dir / rel).resolve()
            is_file = full.is_file()
        except (OSError, RuntimeError, ValueError) as exc:  # symlink loop, name too long, ...
            raise PayloadError(
                f"{kind} value {name!r}: external location {location!r} cannot be resolved: {exc}"
            ) from None
        if self.base_dir not in full.parents:
            raise PayloadError(
                f"{kind} value {name!r}: external location {location!r} escapes the model "
                f"directory {str(self.base_dir)!r}"
            )
        if not is_file:
            raise PayloadError(
                f"{kind} value {name!r}: external data file {location!r} not found in "
                f"{str(self.base_dir)!r}"
            )
        return full

    def _map(self, file_path: pathlib.Path) -> np.ndarray:
        entry = self._maps.get(file_path)
        if entry is None:
            try:
                fh = open(file_path, "rb")
            except OSError as exc:
                raise PayloadError(
                    f"external data file {str(file_path)!r} cannot be opened: {exc.strerror}"
                ) from None
            with fh:
                st = os.fstat(fh.fileno())
                size = st.st_size
                self._stamps[file_path] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
                if size == 0:
                    arr = np.zeros(0, np.uint8)
                    entry = (None, arr)
                else:
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                    arr = np.frombuffer(mm, dtype=np.uint8)
                    entry = (mm, arr)
            self._maps[file_path] = entry
        return entry[1]

    def check_external_files(self) -> None:
        """Check that the external data files mapped so far are unchanged since they were mapped.

        Called by :class:`~olv_runtime.InferenceSession` at the start of every run, and by
        :func:`as_model` whenever a loaded :class:`Model` is handed to an entry point (session
        creation, ``decode_value``, ``to_decoded``, ``compile_model``, ``save``, ...) before
        that code reads a mapped page: one ``os.stat`` per mapped file, comparing size,
        modification time (ns), inode and device with the values recorded when the file was
        mapped.

        Raises
        ------
        PayloadError
            A mapped file was truncated, extended, rewritten, replaced or removed. Payloads are
            live read-only memory maps, so reading a truncated map would kill the process with
            SIGBUS and a file rewritten in place would silently change the results; the model
            is refused instead (reload it).

        Notes
        -----
        This narrows but cannot close the race: a file changed *during* a run (after this
        check) can still fault or change values mid-run, as with any memory-mapped weights
        (llama.cpp documents the same for its mmap). Keep model files immutable while a session
        uses them.
        """
        for path, stamp in self._stamps.items():
            try:
                st = os.stat(path)
            except OSError as exc:
                raise PayloadError(
                    f"external data file {str(path)!r} of the loaded model is no longer readable "
                    f"({exc.strerror}); reload the model"
                ) from None
            now = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
            if now != stamp:
                what = (f"its size changed from {stamp[0]} to {st.st_size} bytes"
                        if now[0] != stamp[0] else
                        "it was replaced" if now[2:] != stamp[2:] else
                        "it was modified in place (modification time changed)")
                raise PayloadError(
                    f"external data file {str(path)!r} changed after the model was loaded: "
                    f"{what}; its payloads are memory-mapped, so the loaded model can no longer "
                    "be used (reload the model)"
                )

    # -- convenience ---------------------------------------------------------------------------
    @property
    def graph(self):
        """The root ``GraphProto``."""
        return self.proto.graph

    def metadata(self) -> dict[str, str]:
        """``metadata_props`` as a dict."""
        return {p.key: p.value for p in self.proto.metadata_props}

    def __repr__(self) -> str:
        g = self.proto.graph
        return (
            f"Model(path={str(self.path) if self.path else None!r}, nodes={len(g.node)}, "
            f"initializers={len(g.initializer)}, encoded={len(g.encoded_initializer)}, "
            f"bindings={len(g.persistent_bindings)})"
        )


#: Longest ``.npy`` header accepted by :func:`read_npy_header` (numpy writes 118-128 bytes).
NPY_HEADER_MAX = 4096
#: The header numpy writes (format 1.0-3.0): descr, fortran_order, shape; nothing else.
_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=][A-Za-z][0-9]{0,3})', 'fortran_order': (False|True), "
    r"'shape': \(((?:[0-9]{1,19}, )*[0-9]{1,19},?|)\), \} *\n?")


def read_npy_header(fh, what: str, error=ValueError) -> tuple:
    """Read and check the header of a ``.npy`` stream (``fh`` at its first byte) without
    numpy's parser: the magic, a header of at most :data:`NPY_HEADER_MAX` bytes matching the
    form numpy writes exactly (no nesting to recurse into), a fixed-size, non-object dtype,
    C order, and a shape of non-negative integers. Nothing is allocated from the header.

    Parameters
    ----------
    fh : binary file object
    what : str
        Names the stream in messages (a path, an archive member).
    error : type
        The exception class raised (an :class:`~olv_runtime.errors.OlvError` subclass).

    Returns
    -------
    (numpy.dtype, tuple of int, int)
        The dtype, the shape and the data size in bytes (checked: it fits in an int64).

    Raises
    ------
    error
        Not a ``.npy`` stream, an unknown version, a header too long or not of numpy's form,
        an object/structured/unsized dtype, Fortran order, or a size beyond 2**63 bytes.
    """
    head = fh.read(8)
    if len(head) < 8 or head[:6] != b"\x93NUMPY":
        raise error(f"{what}: not a .npy array (no \\x93NUMPY magic)")
    major = head[6]
    if major == 1:
        raw = fh.read(2)
        n = int.from_bytes(raw, "little") if len(raw) == 2 else -1
    elif major in (2, 3):
        raw = fh.read(4)
        n = int.from_bytes(raw, "little") if len(raw) == 4 else -1
    else:
        raise error(f"{what}: .npy format version {major}.{head[7]} is not supported "
                    "(1.0-3.0)")
    if not 0 < n <= NPY_HEADER_MAX:
        raise error(f"{what}: .npy header length {n} is not in [1, {NPY_HEADER_MAX}] bytes")
    text = fh.read(n)
    if len(text) != n:
        raise error(f"{what}: truncated .npy header ({len(text)} of {n} bytes)")
    try:
        got = _NPY_HEADER.fullmatch(text.decode("latin-1"))
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        got = None
    if got is None:
        raise error(f"{what}: the .npy header is not numpy's form "
                    f"({text[:80].decode('latin-1')!r})")
    descr, fortran, dims = got.groups()
    try:
        dtype = np.dtype(descr)
    except TypeError:
        raise error(f"{what}: .npy dtype {descr!r} is not a dtype") from None
    if dtype.hasobject or dtype.itemsize == 0 or dtype.fields is not None:
        raise error(f"{what}: .npy dtype {descr!r} is not a fixed-size numeric dtype")
    if fortran == "True":
        raise error(f"{what}: .npy array in Fortran order; expected C order")
    shape = tuple(int(d) for d in dims.replace(",", " ").split())
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
        if nbytes >= 1 << 63:
            raise error(f"{what}: .npy shape {shape} of {descr} is {nbytes} bytes or more, "
                        "beyond any file")
    return dtype, shape, nbytes


def same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file: the same resolved path, or (both existing)
    the same inode (a hard link). Unresolvable paths are not the same file."""
    a, b = pathlib.Path(a), pathlib.Path(b)
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError, ValueError):
        return False


def model_files(model: "Model") -> list:
    """``(what, path)`` of every file a loaded model reads: the model file, its external data
    files (every external location of its payloads, and any file already mapped), the payload
    files of its compiled entries and the sidecars beside it (tokenizer.json, ...). Used to
    refuse an output that would overwrite one of them (:func:`check_output_not_input`)."""
    if model.path is None:
        return []
    out = [("the model file", model.path)]
    base = model.base_dir

    def add(what, loc):
        try:
            out.append((what, (base / pathlib.PurePosixPath(loc.replace("\\", "/"))).resolve()))
        except (OSError, RuntimeError, ValueError):
            pass

    for msg in _payload_messages(model.proto):
        if msg.data_location == TensorProto.EXTERNAL:
            loc = next((x.value for x in msg.external_data if x.key == "location"), None)
            if loc:
                add("an external data file", loc)
    for e in model.proto.compiled_tensors:
        if e.value.data_location == TensorProto.EXTERNAL:
            loc = next((x.value for x in e.value.external_data if x.key == "location"), None)
            if loc:
                add("the compiled payload file", loc)
    out += [("an external data file", pathlib.Path(p)) for p in model._maps]
    out += [("the compiled payload file", pathlib.Path(p))
            for p in model.__dict__.get("_compiled_maps", {})]
    out += [(f"the model's {n}", model.path.parent / n) for n in SIDECAR_FILES
            if (model.path.parent / n).exists()]
    seen, unique = set(), []
    for what, path in out:
        if path not in seen:
            seen.add(path)
            unique.append((what, path))
    return unique


def check_output_not_input(out, inputs, option: str) -> None:
    """Refuse output path ``out`` (given as ``option``) when it is one of ``inputs`` (``(what,
    path)``: :func:`model_files`, input files of the command) by :func:`same_file` (resolved
    path or inode), before anything is written.

    Raises
    ------
    OutputError
        Naming the option, the path and the input it would overwrite.
    """
    for what, path in inputs:
        if same_file(out, path):
            raise OutputError(f"{option} {str(out)!r} would overwrite {what} {str(path)!r}: "
                              "refusing, nothing was written (choose another path)")


def as_model(model) -> Model:
    """Accept a :class:`Model`, an ``olv_runtime.proto.ModelProto``, an ``onnx.ModelProto`` or a path.

    An ``onnx.ModelProto`` (a different Python class over the same wire format) is re-parsed
    through its serialized bytes: an explicit, documented copy made once.

    A :class:`Model` is returned as it is, after :meth:`Model.check_external_files` (one
    ``os.stat`` per file it has mapped): the callers read its memory-mapped payloads next, and
    a mapped file truncated since must raise, not kill the process with SIGBUS.

    Raises
    ------
    ModelFormatError
        Anything else.
    PayloadError
        A file the model has mapped changed since (truncated, rewritten, replaced, removed).
    """
    if isinstance(model, Model):
        model.check_external_files()
        return model
    if isinstance(model, ModelProto):
        return Model(model)
    if isinstance(model, (str, os.PathLike)):
        return load(model)
    if type(model).__name__ == "ModelProto" and hasattr(model, "SerializeToString"):
        try:
            proto = ModelProto.FromString(model.SerializeToString())
        except Exception as exc:  # protobuf's DecodeError / EncodeError
            raise ModelFormatError(f"the {type(model).__module__} ModelProto cannot be "
                                   f"re-parsed: {exc}") from None
        check_strings(proto, "ModelProto")
        return Model(proto)
    raise ModelFormatError(
        f"expected a Model, ModelProto or path, got {type(model).__name__}"
    )



def _file_kind(p) -> str:
    """What a non-regular existing path is (for error messages)."""
    mode = os.stat(p).st_mode
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"

def load(path: PathLike) -> Model:
    """Load a model file written by olv_runtime or by any ONNX tool.

    Parameters
    ----------
    path : path-like
        ``.onnx`` file. External data files are resolved relative to its directory when a
        payload is first accessed (and memory-mapped read-only).

    Returns
    -------
    Model

    Raises
    ------
    ModelFormatError
        The file is missing or is not a parseable ModelProto.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ModelFormatError(f"expected a model path, got {type(path).__name__}")
    if "\0" in os.fspath(path):
        raise ModelFormatError(f"model path {os.fspath(path)!r} contains a NUL byte")
    p = pathlib.Path(path)
    if p.is_dir():
        raise ModelFormatError(
            f"{str(p)!r} is a directory, not a model file (pass the .onnx file inside it)"
        )
    if not p.is_file():
        if p.exists():  # a device, FIFO or socket: reading it could block or never end
            raise ModelFormatError(
                f"{str(p)!r} is not a regular file ({_file_kind(p)}); pass the .onnx model file")
        raise ModelFormatError(f"model file not found: {str(p)!r}")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFormatError(f"cannot read model file {str(p)!r}: {exc.strerror}") from None
    if magic == b"GGUF":
        raise ModelFormatError(
            f"{str(p)!r} is a GGUF file, not an ONNX model; convert it first: "
            f"olv convert {str(p)!r} out.onnx (or olv_runtime.convert)"
        )
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ModelFormatError(f"cannot read model file {str(p)!r}: {exc.strerror}") from None
    if not data:
        raise ModelFormatError(f"model file {str(p)!r} is empty (0 bytes)")
    try:
        proto = ModelProto.FromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise ModelFormatError(f"{str(p)!r} is not a valid ModelProto: {exc}") from None
    if not proto.HasField("graph") and not len(proto.opset_import):
        raise ModelFormatError(
            f"{str(p)!r} does not look like an ONNX model ({len(data)} bytes parse as a "
            "ModelProto with no graph and no opset_import)"
        )
    check_strings(proto, str(p))
    model = Model(proto, p)
    adapt(model)
    return model


def check_strings(message, what: str) -> None:
    """Check that every ``string`` field of a parsed message is valid UTF-8.

    protobuf's parser does not validate proto2 ``string`` fields; an invalid one comes back as
    ``bytes`` and would surface later as a ``TypeError`` deep inside the runtime. Walks the
    message iteratively (no recursion limit).

    Raises
    ------
    ModelFormatError
        Naming the field path (``graph.node[3].name``) and the bytes.
    """
    string = FieldDescriptor.TYPE_STRING
    msg_type = FieldDescriptor.TYPE_MESSAGE
    stack = [(message, "")]
    while stack:
        msg, path = stack.pop()
        for fd, value in msg.ListFields():
            fp = f"{path}.{fd.name}" if path else fd.name
            repeated = fd.is_repeated
            if fd.type == string:
                items = enumerate(value) if repeated else ((None, value),)
                for i, v in items:
                    if not isinstance(v, str):
                        where = fp if i is None else f"{fp}[{i}]"
                        raise ModelFormatError(
                            f"{what}: string field {where} is not valid UTF-8 ({bytes(v)[:40]!r})"
                        )
            elif fd.type == msg_type:
                if fd.message_type.GetOptions().map_entry:
                    continue
                if repeated:
                    stack.extend((v, f"{fp}[{i}]") for i, v in enumerate(value))
                else:
                    stack.append((value, fp))


def _decimal(text: str, field: str, kind: str, name: str) -> int:
    """An external-data ``offset``/``length``: ASCII decimal digits only (ONNX IR: "decimal")."""
    if text.startswith("-") and _DECIMAL.fullmatch(text[1:]):
        raise PayloadError(
            f"{kind} value {name!r}: negative offset or length ({field} {text})"
        )
    if not _DECIMAL.fullmatch(text):
        raise PayloadError(
            f"{kind} value {name!r}: bad offset/length: external-data {field} must be ASCII "
            f"decimal digits, got {text!r}"
        )
    return int(text)


def _payload_messages(proto: ModelProto, params: bool = True
                      ) -> Iterator[TensorProto | EncodedValueProto]:
    g = proto.graph
    yield from g.initializer
    yield from g.encoded_initializer
    for ev in g.encoded_initializer:  # affine scale / zero_point (large: one per block)
        if ev.WhichOneof("layout") == "affine" and (
                params or ev.affine.scale.data_location == TensorProto.EXTERNAL
                or ev.affine.zero_point.data_location == TensorProto.EXTERNAL):
            yield ev.affine.scale
            if ev.affine.HasField("zero_point"):
                yield ev.affine.zero_point


def _payload_keys(proto: ModelProto, params: bool = True) -> Iterator[tuple]:
    g = proto.graph
    for t in g.initializer:
        yield ("tensor", t.name)
    for ev in g.encoded_initializer:
        yield ("encoded", ev.name)
    for ev in g.encoded_initializer:
        if ev.WhichOneof("layout") == "affine" and (
                params or ev.affine.scale.data_location == TensorProto.EXTERNAL
                or ev.affine.zero_point.data_location == TensorProto.EXTERNAL):
            yield ("scale", ev.name)
            if ev.affine.HasField("zero_point"):
                yield ("zero_point", ev.name)


def save(
    model,
    path: PathLike,
    *,
    external_data: bool | None = None,
    location: str | None = None,
    threshold: int = EXTERNAL_THRESHOLD,
    keep_external: bool = False,
    external_params: bool = False,
) -> pathlib.Path:
    """Write a model; large payloads optionally go to one external data file beside it.

    Parameters
    ----------
    model : Model or ModelProto
        The model. It is not modified (external-data bookkeeping is written into a copy).
    path : path-like
        Destination ``.onnx`` file.
    external_data : bool, optional
        ``True``: payloads of ``threshold`` bytes or more (dense and encoded initializers) go to
        ``location``; ``False``: everything inline; ``None`` (default): external only when the
        model's serialized size exceeds 256 MiB.
    location : str, optional
        External file name relative to ``path``'s directory (default ``<file name>.data``).
    threshold : int
        Minimum payload size in bytes moved to the external file.
    keep_external : bool
        Leave payloads that are already external exactly as they are (same location, offset,
        length; nothing read or copied): for models whose payloads live in another file, e.g.
        a GGUF import (``models/gguf.py``). The locations must resolve from ``path``'s
        directory.
    external_params : bool
        Also move the scale / zero_point tensors of affine encoded initializers (default False:
        they stay inline; ``olv compile`` sets it so that a session using compiled entries never
        parses them into the proto). Parameters already external always stay readable.

    Returns
    -------
    pathlib.Path
        The model path written.

    Raises
    ------
    ModelFormatError
        Payloads that must go external are themselves external in a model without a directory.
    OutputError
        ``path`` is a directory or cannot be written (read-only, impossible location, disk
        full): the message names the path.

    Notes
    -----
    Files are written to temporary names and renamed into place, so a failed save leaves
    existing files as they were. External payloads are aligned to 64 bytes.
    """
    out = pathlib.Path(path)
    if out.is_dir():
        raise OutputError(f"cannot write model {str(out)!r}: it is an existing directory")
    try:
        return _save(model, out, external_data, location, threshold, keep_external,
                     external_params)
    except OSError as exc:
        if isinstance(exc, OutputError):
            raise
        raise OutputError(
            f"cannot write model {str(out)!r}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(out) else "")
        ) from None


def _save(model, out, external_data, location, threshold, keep_external, external_params):
    staged = stage_save(model, out, external_data=external_data, location=location,
                        threshold=threshold, keep_external=keep_external,
                        external_params=external_params)
    commit_staged(staged)
    return out


def commit_staged(staged: list) -> None:
    """Rename staged ``(temporary file, final path)`` pairs into place, all or none as far as
    the file system allows: every final path is checked first (an existing directory, a parent
    that is not a directory: nothing is renamed), then the renames run. On failure the
    temporary files not yet renamed are removed.

    Raises
    ------
    OutputError
        Naming the final path that cannot be written (never the temporary name).
    """
    try:
        for _tmp, final in staged:
            final = pathlib.Path(final)
            if final.is_dir():
                raise OutputError(f"cannot write {str(final)!r}: it is an existing directory")
            if not final.parent.is_dir():
                raise OutputError(f"cannot write {str(final)!r}: {str(final.parent)!r} is not a "
                                  "directory")
        while staged:
            tmp, final = staged[0]
            try:
                os.replace(tmp, final)
            except OSError as exc:
                raise OutputError(
                    f"cannot write {str(final)!r}: {exc.strerror or exc}") from None
            staged.pop(0)
    finally:
        discard_staged(staged)


def discard_staged(staged: list) -> None:
    """Remove the temporary files of staged ``(temporary file, final path)`` pairs."""
    for tmp, _ in staged:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    staged.clear()


def stage_save(model, out, *, external_data, location=None, threshold=EXTERNAL_THRESHOLD,
               keep_external=False, external_params=False) -> list:
    """:func:`save` without the final renames: writes the model (and its external data file)
    to temporary files in ``out``'s directory and returns the ``(temporary file, final path)``
    pairs for :func:`commit_staged` (or :func:`discard_staged`). Nothing is renamed; on an
    error the temporary files are removed."""
    m = as_model(model)
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = m.proto.ByteSize() > AUTO_EXTERNAL_BYTES
    proto = ModelProto()
    proto.CopyFrom(m.proto)
    data_name = location or (out.name + ".data")
    tmp_files: list[tuple[str, pathlib.Path]] = []
    try:
        if external_data:
            fd, tmp_data = tempfile.mkstemp(dir=out.parent, prefix=".olv-", suffix=".data")
            tmp_files.append((tmp_data, out.parent / data_name))
            with os.fdopen(fd, "wb") as fh:
                offset = 0
                for msg, src, key in zip(_payload_messages(proto, external_params),
                                         _payload_messages(m.proto, external_params),
                                         _payload_keys(m.proto, external_params)):
                    if msg.data_location == TensorProto.EXTERNAL and keep_external:
                        continue
                    if msg.data_location == TensorProto.EXTERNAL:
                        payload = m.payload(src, key)
                    elif msg.HasField("raw_data"):
                        payload = msg.raw_data
                    else:
                        continue
                    if len(payload) < threshold:
                        if msg.data_location == TensorProto.EXTERNAL:
                            _inline(msg, payload)
                        continue
                    pad = (-offset) % _ALIGN
                    if pad:
                        fh.write(b"\0" * pad)
                        offset += pad
                    fh.write(memoryview(payload))
                    msg.ClearField("raw_data")
                    del msg.external_data[:]
                    msg.external_data.add(key="location", value=data_name)
                    msg.external_data.add(key="offset", value=str(offset))
                    msg.external_data.add(key="length", value=str(len(payload)))
                    msg.data_location = TensorProto.EXTERNAL
                    offset += len(payload)
        else:
            for msg, src, key in zip(_payload_messages(proto), _payload_messages(m.proto),
                                     _payload_keys(m.proto)):  # inline everything
                if msg.data_location == TensorProto.EXTERNAL and not keep_external:
                    _inline(msg, m.payload(src, key))
        fd, tmp_model = tempfile.mkstemp(dir=out.parent, prefix=".olv-", suffix=".onnx")
        tmp_files.append((tmp_model, out))
        with os.fdopen(fd, "wb") as fh:
            fh.write(proto.SerializeToString())
        umask = os.umask(0)
        os.umask(umask)
        for tmp, final in tmp_files:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual file mode
        staged, tmp_files = tmp_files, []
    finally:
        discard_staged(tmp_files)
    return staged


def _inline(msg, payload) -> None:
    del msg.external_data[:]
    msg.ClearField("data_location")
    msg.raw_data = bytes(payload)
