"""Issue 26 item 3: state files are checked before they are inflated.

Each ``.npz`` member's compression and declared sizes and its ``.npy`` header (dtype, shape)
are validated against the model before anything is decompressed or allocated; a FIFO is
refused, never waited on; a file that is not a zip archive is "not a state file". The cases that
could exhaust memory or hang run in a child process with a 2 GiB address-space cap
(tests/hostile.py); each must end in a StateFileError within a generous time bound.
"""
from __future__ import annotations

import io
import json
import os
import pathlib
import struct
import zipfile

import numpy as np
import pytest

import olv_runtime
from olv_runtime.errors import StateFileError
from olv_runtime.io import read_npy_header

from hostile import run_cases

PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def sess(tiny_chat_models):
    return olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))


@pytest.fixture(scope="module")
def good(sess, tmp_path_factory) -> pathlib.Path:
    _, state = olv_runtime.generate(sess, PROMPT, 3, return_state=True, temperature=0.8, seed=3)
    path = state.save(tmp_path_factory.mktemp("state") / "good.npz")
    state.close()
    return path


def _members(path: pathlib.Path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


def _npy(arr: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array(b, arr, allow_pickle=False)
    return b.getvalue()


def _write(dst: pathlib.Path, members: dict, compress=zipfile.ZIP_STORED) -> pathlib.Path:
    with zipfile.ZipFile(dst, "w", compression=compress) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return dst


def _header(path: pathlib.Path) -> dict:
    raw = _members(path)["__header__.npy"]
    return json.loads(np.load(io.BytesIO(raw)).tobytes().decode())


def _with_header(good, dst, header_bytes: bytes) -> pathlib.Path:
    m = _members(good)
    m["__header__.npy"] = _npy(np.frombuffer(header_bytes, np.uint8))
    return _write(dst, m)


def _raw_npy_header(text: str) -> bytes:
    body = text.encode("latin-1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body


def _patch_central_sizes(path: pathlib.Path, member: str, compress_size: int, file_size: int):
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02")  # the first central directory entry
    while True:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        name = bytes(data[at + 46:at + 46 + name_len]).decode()
        if name == member:
            struct.pack_into("<II", data, at + 20, compress_size, file_size)
            break
        extra, comment = struct.unpack_from("<HH", data, at + 30)
        at += 46 + name_len + extra + comment
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------
# the good file still restores (and the checks see a real file's members)
# ------------------------------------------------------------------------------------------------
def test_good_file_restores(sess, good):
    state = olv_runtime.load_state(sess, good)
    assert state.tokens[:len(PROMPT)] == PROMPT and state.rng is not None
    state.close()


# ------------------------------------------------------------------------------------------------
# in-process cases (refused before any large allocation)
# ------------------------------------------------------------------------------------------------
def test_non_zip_is_not_a_state_file(sess, tmp_path):
    for name, data in (("text.npz", b"hello, I am not an archive"),
                       ("pickled.npz", b"\x80\x04\x95" + b"\0" * 40),
                       ("empty.npz", b"")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(StateFileError, match="not a state file") as exc:
            olv_runtime.load_state(sess, tmp_path / name)
        assert "allow_pickle" not in str(exc.value)
    np.save(tmp_path / "bare.npy", np.zeros(3))
    with pytest.raises(StateFileError, match="not a state file .*bare .npy"):
        olv_runtime.load_state(sess, tmp_path / "bare.npy")


def test_compressed_member_is_refused_before_inflating(sess, good, tmp_path):
    bad = _write(tmp_path / "deflated.npz", _members(good), zipfile.ZIP_DEFLATED)
    with pytest.raises(StateFileError, match=r"'__header__\.npy' is compressed .* not inflated"):
        olv_runtime.load_state(sess, bad)


def test_declared_sizes_beyond_the_file(sess, good, tmp_path):
    bad = tmp_path / "sizes.npz"
    bad.write_bytes(good.read_bytes())
    _patch_central_sizes(bad, "__header__.npy", 0xFFFFFFF0, 0xFFFFFFF0)
    with pytest.raises(StateFileError, match=r"declares 4294967280 bytes .* in a file of"):
        olv_runtime.load_state(sess, bad)
    bad.write_bytes(good.read_bytes())
    _patch_central_sizes(bad, "__header__.npy", 200, 0xFFFFFFF0)
    with pytest.raises(StateFileError, match=r"declares 4294967280 bytes \(200 stored\)"):
        olv_runtime.load_state(sess, bad)


def test_npy_header_shape_checked_against_the_model(sess, good, tmp_path):
    m = _members(good)
    name = next(n for n in m if n != "__header__.npy")
    raw = m[name]
    arr = np.load(io.BytesIO(raw))
    cases = {
        # a header declaring 4 TiB of data (the data stays as it was)
        "huge": _raw_npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': "
                                "(1099511627776,), }\n") + raw[128:],
        "dtype": _npy(arr.astype(np.float64)),
        "heads": _npy(np.zeros((1, arr.shape[1] + 1) + arr.shape[2:], arr.dtype)),
        "positions": _npy(np.zeros(arr.shape[:2] + (arr.shape[2] + 1, arr.shape[3]),
                                   arr.dtype)),
        "fortran": _npy(np.asfortranarray(np.zeros((2, 3), np.float32))),
        "object": _raw_npy_header("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }\n")
        + b"\0" * 16,
    }
    want = {"huge": r"header declares \(1099511627776,\) float32", "dtype": r"is float64\[", "heads": "expects",
            "positions": "hold different numbers of positions", "fortran": "Fortran order",
            "object": "not a fixed-size numeric dtype"}
    for key, data in cases.items():
        mm = dict(m)
        mm[name] = data
        bad = _write(tmp_path / f"{key}.npz", mm)
        with pytest.raises(StateFileError, match=want[key]):
            olv_runtime.load_state(sess, bad)


def test_deep_npy_header_is_refused_without_recursion(sess, good, tmp_path):
    m = _members(good)
    deep = "(" * 200_000 + ")" * 200_000
    m["__header__.npy"] = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(deep) + 1) + \
        deep.encode() + b"\n"
    bad = _write(tmp_path / "deep.npz", m)
    with pytest.raises(StateFileError, match=r"\.npy header length 400001 is not in"):
        olv_runtime.load_state(sess, bad)
    m["__header__.npy"] = _raw_npy_header("{'descr': '|u1', 'fortran_order': False, 'shape': "
                                          "((((((1,),),),),),), }\n")
    bad = _write(tmp_path / "nested.npz", m)
    with pytest.raises(StateFileError, match="not numpy's form"):
        olv_runtime.load_state(sess, bad)


def test_deep_json_header(sess, good, tmp_path):
    h = json.dumps(_header(good))
    deep = h.replace('"tokens": [', '"tokens": ' + "[" * 200_000 + "[", 1).replace(
        "]", "]" + "]" * 200_000, 1)
    bad = _with_header(good, tmp_path / "deepjson.npz", deep.encode())
    with pytest.raises(StateFileError, match="malformed state header .*Recursion"):
        olv_runtime.load_state(sess, bad)


@pytest.mark.parametrize("rng, match", [
    ({"state": {"state": 2 ** 300, "inc": 1}}, r"state\.state must be an integer in \[0, 2\*\*128\)"),
    ({"state": {"state": 1, "inc": -1}}, r"state\.inc must be"),
    ({"uinteger": 2 ** 40}, r"uinteger must be an integer in \[0, 2\*\*32\)"),
    ({"has_uint32": 7}, "has_uint32 must be"),
    ({"extra": 1}, "keys"),
    ({"state": [1, 2]}, "'state' must be an object"),
])
def test_rng_state_out_of_range(sess, good, tmp_path, rng, match):
    h = _header(good)
    h["rng"] = {**h["rng"], **rng}
    bad = _with_header(good, tmp_path / "rng.npz", json.dumps(h).encode())
    with pytest.raises(StateFileError, match=r"header 'rng' is not a PCG64 .*" + match):
        olv_runtime.load_state(sess, bad)


def test_too_many_members(sess, good, tmp_path):
    m = _members(good)
    m.update({f"x{i}.npy": b"" for i in range(5000)})
    bad = _write(tmp_path / "many.npz", m)
    with pytest.raises(StateFileError, match="lists 50\\d\\d members; a state file has at most"):
        olv_runtime.load_state(sess, bad)


def test_value_names_must_be_the_models(sess, good, tmp_path):
    h = _header(good)
    h["values"] = h["values"][:1] + h["values"][:1]
    bad = _with_header(good, tmp_path / "dup.npz", json.dumps(h).encode())
    with pytest.raises(StateFileError, match="the saved values are .* the model binds"):
        olv_runtime.load_state(sess, bad)


def test_read_npy_header_known_answers():
    for arr in (np.zeros((1, 2, 0, 16), np.float32), np.arange(5, dtype=np.uint8),
                np.zeros((), np.int64), np.zeros((3, 4), ">i8")):
        dt, shape, n = read_npy_header(io.BytesIO(_npy(arr)), "x")
        assert (dt, shape, n) == (arr.dtype, arr.shape, arr.nbytes)
    with pytest.raises(ValueError, match="is .* bytes or more, beyond any file"):
        read_npy_header(io.BytesIO(_raw_npy_header(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }\n")),
            "x")


# ------------------------------------------------------------------------------------------------
# the hang / memory classes, in a capped child process
# ------------------------------------------------------------------------------------------------
def test_bombs_and_fifo_in_a_capped_child(tiny_chat_models, good, tmp_path):
    m = _members(good)
    # a deflate bomb: 512 MiB of zeros as the header member, compressed to ~0.5 MB
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("__header__.npy", "w", force_zip64=True) as fh:
            fh.write(_raw_npy_header("{'descr': '|u1', 'fortran_order': False, 'shape': "
                                     f"({512 << 20},), }}\n"))
            zero = bytes(16 << 20)
            for _ in range(32):
                fh.write(zero)
        for k, v in m.items():
            if k != "__header__.npy":
                zf.writestr(k, v)
    assert bomb.stat().st_size < 4 << 20
    # a header member declaring 4 TiB of uint8 (the file holds a few hundred bytes)
    huge = dict(m)
    huge["__header__.npy"] = _raw_npy_header(
        "{'descr': '|u1', 'fortran_order': False, 'shape': (4398046511104,), }\n") + b"{}"
    hugep = _write(tmp_path / "huge_header.npz", huge)
    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    cases = [(name, f"olv_runtime.load_state(sess, {str(p)!r})")
             for name, p in (("bomb", bomb), ("huge_header", hugep), ("fifo", fifo))]
    got = run_cases(f"import olv_runtime\nsess = olv_runtime.InferenceSession("
                    f"olv_runtime.load({str(tiny_chat_models['int4'])!r}))", cases,
                    timeout=240, mem_bytes=2 << 30)
    want = {"bomb": "is compressed", "huge_header": "(4398046511104 bytes of data)",
            "fifo": "it is a FIFO"}
    for name, match in want.items():
        rec = got.get(name)
        assert rec is not None, got["__exit__"]
        assert rec["outcome"] == "StateFileError", rec
        assert match in rec["msg"], rec
        assert rec["seconds"] < 20, rec
