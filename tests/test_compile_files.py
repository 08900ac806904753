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

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    # this module's own verified-digest cache (never the user's)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLV_CACHE_DIR", str(tmp_path_factory.mktemp("olv-cache")))
        mp.delenv("OLV_VERIFY_DIGESTS", raising=False)
        yield


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
def plain(tmp_path_factory) -> pathlib.Path:
    """A tiny INT4 Qwen2 with external data and tokenizer.json beside it."""
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    root = tmp_path_factory.mktemp("files")
    ckpt = write_random_qwen2(root / "ckpt", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, vocab_size=256, with_tokenizer=True, seed=3)
    (ckpt / "generation_config.json").write_text('{"eos_token_id": 1}')
    out = root / "m" / "model.onnx"
    olv_runtime.convert(ckpt, out, weights="int4-block32", external_data=True)
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
    from olv_runtime.prompt_cache import model_digest

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
