"""Read a Hugging Face checkpoint directory without torch.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (``weight_map``: tensor name → shard file). Safetensors files
are parsed here: an 8-byte little-endian header length, a JSON header mapping each tensor name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the data. Files are memory-mapped; BF16/F16/F32 tensors are returned as float32
numpy arrays (F32 without a copy, as a read-only view of the map).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from olv_runtime.errors import ConversionError

__all__ = ["Checkpoint", "SafetensorsFile", "load_checkpoint", "read_safetensors_header"]

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted to float32 by bit shifting
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# A header larger than this is certainly corrupt (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """Parse the header of a safetensors file.

    Parameters
    ----------
    path : str
        File path.

    Returns
    -------
    header : dict
        The JSON header (including ``__metadata__`` if present).
    data_start : int
        Absolute file offset of the data section.

    Raises
    ------
    ConversionError
        If the file is missing, shorter than its header, or the header is not valid JSON.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ConversionError(
                    f"{path}: truncated or corrupt safetensors file: header length {n}, "
                    f"file size {size}"
                )
            raw = f.read(n)
    except OSError as e:
        raise ConversionError(f"cannot read safetensors file {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


class SafetensorsFile:
    """One memory-mapped safetensors file.

    Parameters
    ----------
    path : str
        File path. The header is parsed and every entry's extent checked against the file size
        on construction; the data is mapped lazily on first access.

    Raises
    ------
    ConversionError
        Missing/truncated file, malformed header, or an entry whose byte extent disagrees with
        its dtype and shape.
    """

    def __init__(self, path: str):
        self.path = path
        header, data_start = read_safetensors_header(path)
        self.metadata = header.pop("__metadata__", None) or {}
        size = os.path.getsize(path)
        self._entries: dict[str, _Entry] = {}
        for name, info in header.items():
            try:
                dtype = str(info["dtype"])
                shape = tuple(int(d) for d in info["shape"])
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise ConversionError(f"{path}: malformed header entry for tensor {name!r}") from err
            count = int(np.prod(shape, dtype=np.int64))
            item = _ITEMSIZE.get(dtype)
            if item is not None and e - b != count * item:
                raise ConversionError(
                    f"{path}: tensor {name!r} ({dtype} {list(shape)}) spans {e - b} bytes, "
                    f"expected {count * item}"
                )
            if b < 0 or e < b or data_start + e > size:
                raise ConversionError(
                    f"{path}: truncated file: tensor {name!r} ends at byte {data_start + e}, "
                    f"file size is {size}"
                )
            self._entries[name] = _Entry(dtype, shape, data_start + b, data_start + e)
        self._file = None
        self._mmap: mmap.mmap | None = None

    def keys(self) -> list[str]:
        """Tensor names in header order."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        """Safetensors dtype string (``"BF16"``, ``"F32"``, ...) of a tensor."""
        return self._entries[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor."""
        return self._entries[name].shape

    def _map(self) -> mmap.mmap:
        if self._mmap is None:
            try:
                self._file = open(self.path, "rb")
                if os.fstat(self._file.fileno()).st_size == 0:
                    raise ConversionError(f"{self.path}: empty file")
                self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise ConversionError(f"cannot map {self.path}: {e}") from e
        return self._mmap

    def get(self, name: str) -> np.ndarray:
        """Return a tensor as float32.

        Parameters
        ----------
        name : str
            Tensor name.

        Returns
        -------
        numpy.ndarray
            float32 array of the tensor's shape. F32 tensors are read-only views of the map;
            BF16/F16 are converted into new arrays.

        Raises
        ------
        ConversionError
            Unknown name or unsupported dtype.
        """
        try:
            ent = self._entries[name]
        except KeyError:
            raise ConversionError(f"{self.path}: no tensor named {name!r}") from None
        if ent.dtype not in _DTYPES:
            raise ConversionError(
                f"{self.path}: tensor {name!r} has unsupported dtype {ent.dtype} "
                f"(supported: {', '.join(_DTYPES)})"
            )
        dt = _DTYPES[ent.dtype]
        count = (ent.end - ent.begin) // dt.itemsize
        if count == 0:
            return np.zeros(ent.shape, dtype=np.float32)
        raw = np.frombuffer(self._map(), dtype=dt, count=count, offset=ent.begin)
        if ent.dtype == "BF16":
            out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        elif ent.dtype == "F16":
            out = raw.astype(np.float32)
        else:
            out = raw.view(np.float32)
        return out.reshape(ent.shape)

    def close(self) -> None:
        """Release the memory map (arrays returned by :meth:`get` must not be used after)."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # Views of the map are still alive; leave it to the garbage collector.
                pass
            self._mmap = None
        if self._file is not None:
            self._file.close()
            self._file = None


class Checkpoint:
    """A Hugging Face checkpoint directory: config and float32 tensors.

    Parameters
    ----------
    path : str or os.PathLike
        Directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` (falling back to every ``*.safetensors`` file).

    Attributes
    ----------
    path : str
    config : dict
        Parsed ``config.json``.

    Raises
    ------
    ConversionError
        Missing directory, config or weight files; invalid JSON; a tensor listed by the index
        but absent from its shard; a tensor present in two files.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        if os.path.isfile(self.path):
            raise ConversionError(
                f"{self.path!r} is a file, not a checkpoint directory (pass the directory that "
                "holds config.json and the *.safetensors files)"
            )
        if not os.path.isdir(self.path):
            raise ConversionError(f"checkpoint directory {self.path!r} does not exist")
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConversionError(f"checkpoint directory {self.path!r} has no config.json")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                self.config = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{cfg_path}: cannot parse: {e}") from e
        if not isinstance(self.config, dict):
            raise ConversionError(f"{cfg_path}: not a JSON object")

        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        single = os.path.join(self.path, "model.safetensors")
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(single):
            self._add_file(single)
        elif os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: cannot parse weight_map: {e}") from e
            for shard in sorted(set(weight_map.values())):
                shard_path = os.path.join(self.path, shard)
                if not os.path.isfile(shard_path):
                    raise ConversionError(f"{index}: shard {shard!r} is missing")
                self._add_file(shard_path)
            for name, shard in weight_map.items():
                f = self._where.get(name)
                if f is None or os.path.basename(f.path) != shard:
                    raise ConversionError(f"{index}: tensor {name!r} is not in shard {shard!r}")
        else:
            files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
            if not files:
                raise ConversionError(
                    f"checkpoint directory {self.path!r} has no model.safetensors, "
                    "model.safetensors.index.json or *.safetensors file"
                )
            for n in files:
                self._add_file(os.path.join(self.path, n))

    def _add_file(self, path: str) -> None:
        f = SafetensorsFile(path)
        self._files[path] = f
        for name in f.keys():
            if name in self._where:
                raise ConversionError(
                    f"tensor {name!r} appears in both {self._where[name].path} and {path}"
                )
            self._where[name] = f

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor (without reading it)."""
        return self._file_of(name).shape(name)

    def dtype(self, name: str) -> str:
        """Stored safetensors dtype of a tensor (``"BF16"``, ``"F16"``, ``"F32"``, ...)."""
        return self._file_of(name).dtype(name)

    def _file_of(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise ConversionError(
                f"checkpoint {self.path!r} has no tensor {name!r}"
            ) from None

    def get(self, name: str) -> np.ndarray:
        """Return a tensor as a float32 numpy array (see :meth:`SafetensorsFile.get`)."""
        return self._file_of(name).get(name)

    __getitem__ = get

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every tensor as float32, by name."""
        return {name: self.get(name) for name in self._where}

    def close(self) -> None:
        """Release the memory maps."""
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_checkpoint(path) -> Checkpoint:
    """Open a checkpoint directory; see :class:`Checkpoint`."""
    return Checkpoint(path)
