"""Files of a loaded model and of ``olv compile``: a mapped file truncated after loading raises at
every entry point (never SIGBUS); compile never overwrites its inputs, writes all or nothing,
carries other devices' payloads and the sidecars into another folder."""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import OutputError

ROOT = pathlib.Path(__file__).resolve().parents[2]


# this module's own verified-digest cache (never the user's): conftest.module_digest_cache
pytestmark = pytest.mark.usefixtures("module_digest_cache")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _sha(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _tree(d: pathlib.Path) -> dict:
    """Every file under ``d`` (relative name -> SHA-256); directories as ``"dir"``."""
    return {str(p.relative_to(d)): ("dir" if p.is_dir() else _sha(p))
            for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_qwen2_dir) -> pathlib.Path:
    """The tiny INT4 Qwen2 with external data and its sidecars (tokenizer.json, ...)."""
    out = tmp_path_factory.mktemp("files") / "m" / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, out, weights="int4-block32", external_data=True)
    return out


@pytest.fixture(scope="module")
def compiled(plain, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("files_c") / "c" / "fast.onnx"
    olv_runtime.compile_model(plain, out)
    return out


# ------------------------------------------------------------------------------------------------
# 1. a mapped file truncated after loading: every entry point raises PayloadError
# ------------------------------------------------------------------------------------------------
_TRUNCATE = textwrap.dedent("""
    import os, sys, olv_runtime
    from olv_runtime.errors import PayloadError
    model_path, victim, call, out = sys.argv[1:5]
    model = olv_runtime.load(model_path)
    olv_runtime.InferenceSession(model)  # maps every file the model uses
    os.truncate(victim, 0)
    calls = {
        "session": lambda: olv_runtime.InferenceSession(model),
        "decode_value": lambda: olv_runtime.decode_value(
            model, model.proto.graph.encoded_initializer[0].name),
        "to_decoded": lambda: olv_runtime.to_decoded(model),
        "compile_model": lambda: olv_runtime.compile_model(model, out),
        "save": lambda: olv_runtime.save(model, out, external_data=True),
    }
    try:
        calls[call]()
    except PayloadError as exc:
        print("PayloadError:", exc)
    else:
        print("no error")
""")


@pytest.mark.parametrize("which", ["compiled", "data", "plain-data"])
def test_truncated_mapped_file_raises_at_every_entry_point(plain, compiled, tmp_path, which):
    src = plain if which == "plain-data" else compiled
    calls = ["session", "decode_value", "to_decoded", "compile_model", "save"]
    for call in calls:
        d = tmp_path / call
        shutil.copytree(src.parent, d)
        model = d / src.name
        victim = d / (src.name + (".compiled" if which == "compiled" else ".data"))
        size = victim.stat().st_size
        r = subprocess.run([sys.executable, "-c", _TRUNCATE, model, victim, call,
                            tmp_path / "out" / call / "x.onnx"],
                           capture_output=True, text=True, env=_env(), timeout=300)
        assert r.returncode == 0, (call, r.returncode, r.stderr[-2000:])  # -7: SIGBUS
        assert r.stdout.startswith("PayloadError:"), (call, r.stdout, r.stderr[-2000:])
        assert str(victim) in r.stdout and f"from {size} to 0 bytes" in r.stdout, r.stdout
    assert not (tmp_path / "out").exists()  # nothing written


def test_prompt_digest_of_a_truncated_model_raises(plain, tmp_path):
    from olv_runtime.errors import PayloadError
    from olv_runtime.state.files import model_digest

    d = tmp_path / "m"
    shutil.copytree(plain.parent, d)
    model = olv_runtime.load(d / plain.name)
    sess = olv_runtime.InferenceSession(model)
    data = d / (plain.name + ".data")
    with open(data, "r+b") as fh:  # same size: the mtime changes (no SIGBUS risk in pytest)
        fh.write(b"\0")
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(PayloadError, match=r"model\.onnx\.data.*modified in place"):
        model_digest(sess)


# ------------------------------------------------------------------------------------------------
# 2. olv compile never overwrites a file its input model reads
# ------------------------------------------------------------------------------------------------
def _copy(src: pathlib.Path, d: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src.parent, d)
    return d / src.name


def test_compile_refuses_outputs_that_are_its_inputs(compiled, plain, tmp_path):
    from olv_runtime.cli import main as cli_main

    c = _copy(compiled, tmp_path / "c")
    z = tmp_path / "z"
    z.mkdir()
    shutil.copy(plain, z / "q.compiled")  # a model whose name is another output's payload file
    shutil.copy(plain.with_name(plain.name + ".data"), z / "q.compiled.data")
    (z / "q.compiled.data").rename(z / "model.onnx.data")  # the location the model records
    h = tmp_path / "h"
    h.mkdir()
    shutil.copy(c, h / "in.onnx")
    shutil.copy(c.with_name(c.name + ".compiled"), h / "fast.onnx.compiled")
    os.link(c.with_name(c.name + ".data"), h / "fast.onnx.data")
    os.link(h / "fast.onnx.data", h / "other.onnx.data")  # the same inode under another name
    cases = [
        (c, c.with_name(c.name + ".data"), "model file", "external data file"),
        (c, c.with_name(c.name + ".compiled"), "model file", "compiled payload file"),
        (z / "q.compiled", z / "q", "payload file", "model file"),
        (z / "q.compiled", z / "model.onnx", "data file", "external data file"),
        (h / "in.onnx", h / "other.onnx", "data file", "external data file"),  # a hard link
    ]
    before = {d: _tree(d) for d in (c.parent, z, h)}
    for src, out, what, whose in cases:
        with pytest.raises(OutputError, match=f"output's {what} .*would overwrite (an|the) "
                                              f".*{whose}.*refusing"):
            olv_runtime.compile_model(src, out)
        assert {d: _tree(d) for d in (c.parent, z, h)} == before, (src, out)
    # the command line says so and exits 2, writing nothing
    assert cli_main(["compile", str(c), str(c.with_name(c.name + ".data"))]) == 2
    assert {d: _tree(d) for d in (c.parent, z, h)} == before


def test_compile_in_place_is_still_allowed(compiled, tmp_path):
    c = _copy(compiled, tmp_path / "c")
    rep = olv_runtime.compile_model(c, c)
    assert rep.entries > 0
    sess = olv_runtime.InferenceSession(olv_runtime.load(c))
    assert sess.counters["compiled_hits"] == rep.entries and sess.counters["compiled_misses"] == 0


# ------------------------------------------------------------------------------------------------
# 3. all or nothing, naming the path that failed
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocked", [".compiled", ".data"])
def test_compile_failure_writes_nothing_and_names_the_target(plain, tmp_path, blocked, capsys):
    from olv_runtime.cli import main as cli_main

    d = tmp_path / "d1"
    (d / ("out.onnx" + blocked)).mkdir(parents=True)
    with pytest.raises(OutputError) as info:
        olv_runtime.compile_model(plain, d / "out.onnx")
    msg = str(info.value)
    assert f"'{d / ('out.onnx' + blocked)}'" in msg and ".olv-" not in msg, msg
    assert sorted(p.name for p in d.iterdir()) == ["out.onnx" + blocked], msg
    assert cli_main(["compile", str(plain), str(d / "out.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"'{d / ('out.onnx' + blocked)}'" in err and "existing directory" in err, err
    assert sorted(p.name for p in d.iterdir()) == ["out.onnx" + blocked]


def test_compile_under_a_file_says_the_parent_is_not_a_directory(plain, tmp_path, capsys):
    from olv_runtime.cli import main as cli_main

    m = _copy(plain, tmp_path / "m")
    assert cli_main(["compile", str(m), str(m / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"'{m}' is not a directory" in err and "File exists" not in err, err


def test_commit_staged_is_all_or_nothing(tmp_path):
    from olv_runtime.io import commit_staged

    a, b = tmp_path / ".t1", tmp_path / ".t2"
    a.write_bytes(b"new a")
    b.write_bytes(b"new b")
    (tmp_path / "a").write_bytes(b"old a")
    (tmp_path / "b").mkdir()
    staged = [(str(a), tmp_path / "a"), (str(b), tmp_path / "b")]
    with pytest.raises(OutputError, match=f"cannot write '{tmp_path / 'b'}': it is an existing "
                                          "directory"):
        commit_staged(staged)
    assert (tmp_path / "a").read_bytes() == b"old a"  # nothing renamed
    assert not a.exists() and not b.exists() and staged == []  # temporary files removed


# ------------------------------------------------------------------------------------------------
# 4. other devices' entries keep their payload in the new folder
# ------------------------------------------------------------------------------------------------
def _as_other_device(path: pathlib.Path, arch: str) -> None:
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    p.devices[0].architecture = arch
    path.write_bytes(p.SerializeToString())


def _payload(model_dir: pathlib.Path, e) -> bytes:
    ext = {x.key: x.value for x in e.value.external_data}
    with open(model_dir / ext["location"], "rb") as fh:
        fh.seek(int(ext["offset"]))
        return fh.read(int(ext["length"]))


def test_compile_carries_other_devices_payloads(compiled, tmp_path):
    from olv_runtime.kernels.layouts import cpu_architecture

    src = _copy(compiled, tmp_path / "src")
    _as_other_device(src, "arm64-sve")
    other = {e.source_name: _payload(src.parent, e)
             for e in olv_runtime.load(src).proto.compiled_tensors}
    out = tmp_path / "out" / "fast2.onnx"
    rep = olv_runtime.compile_model(src, out)
    assert rep.carried == len(other) and rep.dropped == []
    # the records of a merged weight share bytes: carried once, same layout (no duplicate)
    src_size = src.with_name(src.name + ".compiled").stat().st_size
    assert out.with_name(out.name + ".compiled").stat().st_size <= 2 * src_size + 64
    p = olv_runtime.load(out).proto
    archs = [d.architecture for d in p.devices]
    assert archs == ["arm64-sve", cpu_architecture()]
    kept = [e for e in p.compiled_tensors if e.device == 0]
    assert len(kept) == len(other)
    for e in kept:
        ext = {x.key: x.value for x in e.value.external_data}
        assert ext["location"] == "fast2.onnx.compiled"
        assert _payload(out.parent, e) == other[e.source_name]
    # on "that device" (the entry made this CPU's again, this CPU's entries removed) all hit
    q = pb.ModelProto()
    q.CopyFrom(p)
    del q.compiled_tensors[:]
    q.compiled_tensors.extend(kept)
    del q.devices[1:]
    q.devices[0].architecture = cpu_architecture()
    out.write_bytes(q.SerializeToString())
    sess = olv_runtime.InferenceSession(olv_runtime.load(out))
    assert sess.counters["compiled_hits"] == len(kept) and sess.counters["compiled_misses"] == 0
    ref = olv_runtime.InferenceSession(olv_runtime.load(compiled))  # merged views stay zero-copy
    assert sess.counters["bytes_copied_other"] == ref.counters["bytes_copied_other"]
    # in place too (the payload file is rewritten: the kept entries move with their bytes)
    _as_other_device(out, "arm64-sve")
    rep = olv_runtime.compile_model(out, out)
    assert rep.carried == len(kept)
    p = olv_runtime.load(out).proto
    for e in (e for e in p.compiled_tensors if e.device == 0):
        assert _payload(out.parent, e) == other[e.source_name]


def test_compile_drops_other_devices_entries_without_payload(compiled, tmp_path):
    from olv_runtime.models.compile import CompileWarning

    src = _copy(compiled, tmp_path / "src")
    _as_other_device(src, "arm64-sve")
    n = len(olv_runtime.load(src).proto.compiled_tensors)
    os.truncate(src.with_name(src.name + ".compiled"), 64)
    out = tmp_path / "out" / "fast.onnx"
    with pytest.warns(CompileWarning, match=f"dropped {n} compiled entries of other devices.*"
                                            "past the end"):
        rep = olv_runtime.compile_model(src, out)
    assert rep.carried == 0 and len(rep.dropped) == n
    p = olv_runtime.load(out).proto
    assert all(p.devices[e.device].architecture != "arm64-sve" for e in p.compiled_tensors)


# ------------------------------------------------------------------------------------------------
# 5. sidecars follow the model into another folder
# ------------------------------------------------------------------------------------------------
def test_compile_copies_sidecars(plain, tmp_path):
    from olv_runtime.cli import main as cli_main
    from olv_runtime.io.sidecars import SIDECAR_FILES, load_tokenizer

    names = [n for n in SIDECAR_FILES if (plain.parent / n).is_file()]
    assert "tokenizer.json" in names and "generation_config.json" in names
    out = tmp_path / "o" / "fast.onnx"
    rep = olv_runtime.compile_model(plain, out)
    assert rep.sidecars == sorted(names)
    for n in names:
        assert _sha(out.parent / n) == _sha(plain.parent / n)
    assert load_tokenizer(out) is not None
    assert cli_main(["generate", str(out), "--prompt", "a b c", "--max-new-tokens", "2"]) == 0


def test_compile_sidecars_never_replace_silently(plain, compiled, tmp_path):
    from olv_runtime.models.compile import CompileWarning

    # a different tokenizer.json that another model in the folder records: refused
    d = tmp_path / "shared"
    other = _copy(compiled, d)
    tok = d / "tokenizer.json"
    data = bytearray(tok.read_bytes())
    data[-2:-2] = b" "
    tok.write_bytes(bytes(data))
    p = pb.ModelProto.FromString(other.read_bytes())
    for e in p.metadata_props:
        if e.key == "olv.sidecar.tokenizer.json.sha256":
            e.value = hashlib.sha256(bytes(data)).hexdigest()
    other.write_bytes(p.SerializeToString())
    before = _tree(d)
    with pytest.raises(OutputError, match="would replace tokenizer.json of fast.onnx"):
        olv_runtime.compile_model(plain, d / "new.onnx")
    assert _tree(d) == before
    # a different file no model records: replaced, with a warning
    e = tmp_path / "loose"
    e.mkdir()
    (e / "tokenizer.json").write_text("{}")
    with pytest.warns(CompileWarning, match="replaced tokenizer.json"):
        olv_runtime.compile_model(plain, e / "fast.onnx")
    assert _sha(e / "tokenizer.json") == _sha(plain.parent / "tokenizer.json")
