"""Issue 11: CLI and converter mistakes a careless user makes, through the ``olv`` entry point in a
subprocess (``python -m olv_runtime.cli`` with this tree first on PYTHONPATH)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import olv_runtime
from olv_runtime.errors import ConversionError, OutputError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OLV_FUZZ_SELFTEST", None)
    return env


def olv(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "olv_runtime.cli", *map(str, args)],
                          capture_output=True, text=True, env=_env(), timeout=timeout, **kw)


def _one_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _sha(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_qwen2_dir):
    d = tmp_path_factory.mktemp("cli") / "a"
    olv_runtime.convert(tiny_qwen2_dir, d / "model.onnx")
    return d / "model.onnx"


def test_subprocess_imports_this_tree():
    r = subprocess.run([sys.executable, "-c", "import olv_runtime; print(olv_runtime.__file__)"],
                       capture_output=True, text=True, env=_env())
    assert pathlib.Path(r.stdout.strip()).resolve().is_relative_to(ROOT)


# -- item 11: never overwrite an input -------------------------------------------------------
@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "tokenizer.json"])
def test_convert_refuses_to_overwrite_an_input(tmp_path, tiny_qwen2_dir, target):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen2_dir, ckpt)
    before = {f.name: _sha(f) for f in ckpt.iterdir()}
    r = olv("convert", ckpt, ckpt / target)
    _one_error(r, "is an input of this conversion", target)
    assert {f.name: _sha(f) for f in ckpt.iterdir()} == before


# -- item 12: directories and impossible locations ----------------------------------------------
def test_convert_output_directory_and_impossible_locations(tmp_path, tiny_qwen2_dir):
    _one_error(olv("convert", tiny_qwen2_dir, tiny_qwen2_dir), "is an existing directory",
               "model.onnx")
    _one_error(olv("convert", tiny_qwen2_dir, "./", cwd=tmp_path), "is an existing directory")
    _one_error(olv("convert", tiny_qwen2_dir, "/proc/nope/out.onnx"), "/proc/nope/out.onnx")
    afile = tmp_path / "file"
    afile.write_text("x")
    _one_error(olv("convert", tiny_qwen2_dir, afile / "out.onnx"), str(afile / "out.onnx"))
    _one_error(olv("demo", "--workdir", "/proc/nope"), "/proc/nope")
    assert list(tmp_path.iterdir()) == [afile]
    with pytest.raises(OutputError):  # the library says the same
        olv_runtime.save(olv_runtime.load(_first_onnx(tiny_qwen2_dir, tmp_path)), tmp_path)


def _first_onnx(ckpt, tmp_path):
    out = tmp_path / "m" / "model.onnx"
    olv_runtime.convert(ckpt, out)
    return out


# -- item 13: sidecars belong to the model ---------------------------------------------------
def _other_tokenizer(ckpt: pathlib.Path, dst: pathlib.Path, vocab: int) -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(ckpt, dst)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab - 3):
        words[f"w{i}"] = len(words)
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "generation_config.json").read_text())
    cfg["eos_token_id"] = 5
    (dst / "generation_config.json").write_text(json.dumps(cfg))
    return dst


def test_two_models_in_one_folder_do_not_share_sidecars(tmp_path, tiny_qwen2_dir):
    other = _other_tokenizer(tiny_qwen2_dir, tmp_path / "other", 100)
    out = tmp_path / "out"
    assert olv("convert", tiny_qwen2_dir, out / "a.onnx").returncode == 0
    before = {f.name: _sha(f) for f in out.iterdir()}
    # the converter refuses to replace a.onnx's sidecars, and writes nothing
    _one_error(olv("convert", other, out / "b.onnx"), "would replace", "of a.onnx")
    with pytest.raises(OutputError, match="would replace .* of a.onnx"):
        olv_runtime.convert(other, out / "b.onnx")
    assert {f.name: _sha(f) for f in out.iterdir()} == before
    # the same checkpoint again (identical sidecars) and replacing a.onnx itself are fine
    assert olv("convert", tiny_qwen2_dir, out / "a2.onnx").returncode == 0
    (out / "a2.onnx").unlink()
    # sidecars replaced behind the converter's back (copied in by hand) are refused at use
    assert olv("convert", other, tmp_path / "elsewhere" / "b.onnx").returncode == 0
    for f in (tmp_path / "elsewhere").iterdir():
        shutil.copy(f, out / f.name)
    r = olv("generate", out / "a.onnx", "--prompt", "a b c", "--max-new-tokens", 2)
    _one_error(r, "tokenizer.json does not belong to a.onnx", "reconvert")
    assert r.stdout == ""
    with pytest.raises(olv_runtime.OlvError, match="generation_config.json does not belong"):
        olv_runtime.generate(olv_runtime.load(out / "a.onnx"), [1, 2], 2, eos_token_id="auto")
    r = olv("generate", out / "b.onnx", "--prompt", "w1 w2", "--max-new-tokens", 2)
    assert r.returncode == 0, r.stderr  # the folder's current sidecars are b's


def test_tokenizer_larger_than_the_vocabulary(tmp_path, model):
    d = tmp_path / "m"
    shutil.copytree(model.parent, d)
    m = olv_runtime.load(d / "model.onnx")
    for e in m.proto.metadata_props:  # a legacy model (no sidecar record): vocab still checked
        if e.key.startswith("olv.sidecar"):
            e.key = "x." + e.key
    olv_runtime.save(m, d / "model.onnx")
    _other_tokenizer(model.parent, tmp_path / "big", 300)
    shutil.copy(tmp_path / "big" / "tokenizer.json", d / "tokenizer.json")
    r = olv("generate", d / "model.onnx", "--prompt", "w1 w299", "--max-new-tokens", 1)
    _one_error(r, "has 300 tokens but the model's vocabulary is 128")
    assert r.stdout == ""  # nothing echoed before the error


# -- item 14: a corrupt tokenizer does not break --prompt-ids; --output ids ---------------------
def test_corrupt_tokenizer_and_output_ids(tmp_path, model):
    d = tmp_path / "m"
    shutil.copytree(model.parent, d)
    r = olv("generate", d / "model.onnx", "--prompt-ids", "1,2,3", "--max-new-tokens", 3,
            "--output", "ids")
    assert r.returncode == 0, r.stderr
    ids = [int(t) for t in r.stdout.split()]
    assert len(ids) == 3 and all(0 <= t < 128 for t in ids)
    (d / "tokenizer.json").write_text("{not json")
    m = olv_runtime.load(d / "model.onnx")
    for e in m.proto.metadata_props:
        if e.key.startswith("olv.sidecar"):
            e.key = "x." + e.key
    olv_runtime.save(m, d / "model.onnx")
    r = olv("generate", d / "model.onnx", "--prompt-ids", "1,2,3", "--max-new-tokens", 3)
    assert r.returncode == 0, r.stderr
    assert "cannot be read as a tokenizer" in r.stderr and "printing token ids" in r.stderr
    assert [int(t) for t in r.stdout.split()] == ids
    _one_error(olv("generate", d / "model.onnx", "--prompt", "a b", "--max-new-tokens", 1),
               "cannot be read as a tokenizer")


def test_output_ids_with_a_text_prompt(model):
    """--prompt encodes with the tokenizer; --output ids still prints the new ids only (no echo)."""
    r = olv("generate", model, "--prompt", "a b c", "--max-new-tokens", 3, "--output", "ids")
    assert r.returncode == 0, r.stderr
    ids = [int(t) for t in r.stdout.split()]  # raises if the prompt or text were printed
    assert len(ids) == 3 and all(0 <= t < 128 for t in ids)


def test_eval_file_that_is_not_utf8(tmp_path, model):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    _one_error(olv("eval", model, "--file", bad), "not UTF-8 text")
    npy = tmp_path / "broken.npy"
    npy.write_bytes(b"\x93NUMPY garbage")
    _one_error(olv("eval", model, "--file", npy), "not a readable .npy array")


# -- item 15: required tensors are required, unused ones are listed ---------------------------
def _edit_checkpoint(src, dst, drop=(), add=None):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for k in drop:
        del tensors[k]
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_required_tensor_and_unused_tensors(tmp_path, tiny_qwen2_dir):
    ck = _edit_checkpoint(tiny_qwen2_dir, tmp_path / "nobias",
                          drop=["model.layers.1.self_attn.q_proj.bias"])
    r = olv("convert", ck, tmp_path / "x.onnx")
    _one_error(r, "model.layers.1.self_attn.q_proj.bias", "Qwen2ForCausalLM")
    assert not (tmp_path / "x.onnx").exists()
    ck = _edit_checkpoint(tiny_qwen2_dir, tmp_path / "extra",
                          add={"model.extra.weight": np.ones(3, np.float32),
                               "lm_head.weight": np.ones((128, 64), np.float32)})
    r = olv("convert", ck, tmp_path / "y.onnx")
    assert r.returncode == 0, r.stderr
    assert "2 checkpoint tensors are not used" in r.stderr
    assert "lm_head.weight" in r.stderr and "model.extra.weight" in r.stderr
    with pytest.warns(olv_runtime.models.hf.ConversionWarning, match="model.extra.weight"):
        res = olv_runtime.convert(ck, tmp_path / "z.onnx")
    assert res.unused_tensors == ("lm_head.weight", "model.extra.weight")
    with pytest.raises(ConversionError, match="q_proj.bias"):
        olv_runtime.convert(tmp_path / "nobias", tmp_path / "w.onnx")


# -- item 16: messages that say what is wrong -------------------------------------------------
def test_messages_name_the_actual_mistake(tmp_path, model, tiny_qwen2_dir):
    _one_error(olv("generate", model.parent, "--prompt-ids", "1"), "is a directory")
    _one_error(olv("convert", tiny_qwen2_dir / "config.json", tmp_path / "o.onnx"),
               "is a file, not a checkpoint directory")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    _one_error(olv("inspect", empty), "is empty (0 bytes)")
    r = olv("generate", model, "--prompt-ids", "1,500", "--max-new-tokens", 1)
    _one_error(r, "--prompt-ids", "[0, 128)", "got 500")


# -- items 10, 18, 20: argument checks, position warning, warm-up --------------------------------
def test_generate_arguments_positions_and_warm_up(model):
    _one_error(olv("generate", model, "--prompt-ids", "1", "--seed", "-1"), "--seed",
               "expected an integer >= 0, got -1")
    _one_error(olv("generate", model, "--prompt-ids", "1", "--max-new-tokens", "0"),
               "--max-new-tokens", "expected an integer >= 1, got 0")
    r = olv("generate", model, "--prompt-ids", ",".join(["5"] * 250), "--max-new-tokens", 10,
            "--output", "ids", "--timings")  # (the warm-up line is opt-in since issue 26)
    assert r.returncode == 0, r.stderr
    assert "exceeds the model's max_position_embeddings (256)" in r.stderr
    assert "warm-up" in r.stderr and "target" not in r.stderr + r.stdout
    r = olv("generate", model, "--prompt-ids", "1,2", "--max-new-tokens", 2)
    assert r.returncode == 0 and "max_position_embeddings" not in r.stderr
    r = olv("bench", model, "--prompt-len", 250, "--new-tokens", 10, "--runs", 1)
    assert r.returncode == 0, r.stderr
    assert "exceeds the model's max_position_embeddings (256)" in r.stderr


# -- item 17: Ctrl-C stops cleanly with what was generated and the rate ---------------------------
def test_ctrl_c_during_generate(model):
    p = subprocess.Popen([sys.executable, "-m", "olv_runtime.cli", "generate", str(model),
                          "--prompt-ids", "1,2,3", "--max-new-tokens", "100000", "--output", "ids",
                          "--context-limit", "none",  # a long run (the context stops it at 256)
                          "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=_env())
    first = p.stdout.read(8).decode()  # unbuffered: generation has started (ids are streamed)
    assert first.strip(), p.stderr.read()
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = (x.decode() for x in p.communicate(timeout=120))
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "stopped: interrupted (Ctrl-C)" in err
    n = len((first + out).split())
    assert f"generated {n} tokens: decode" in err or f"generated {n + 1} tokens" in err, (n, err)


# -- item 21: convert() returns something with a short repr --------------------------------------
def test_convert_result_repr(tmp_path, tiny_qwen2_dir):
    res = olv_runtime.convert(tiny_qwen2_dir, tmp_path / "m.onnx")
    text = repr(res)
    assert len(text) < 200 and str(tmp_path / "m.onnx") in text and "MB" in text, text
    assert "Qwen2ForCausalLM" in text and "2 layers" in text
    assert res.nbytes == (tmp_path / "m.onnx").stat().st_size
    assert len(res.graph.node) == len(res.proto.graph.node) > 0


# -- a GGUF file handed to a command that needs a converted model ------------------------------
def test_unconverted_gguf_names_the_conversion(tmp_path):
    from olv_runtime.errors import ModelFormatError
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    with pytest.raises(ModelFormatError, match="is a GGUF file, not an ONNX model.*olv convert"):
        olv_runtime.load(f)
    _one_error(olv("generate", f, "--prompt-ids", "1,2"), "is a GGUF file", "olv convert")


# -- typos get a "did you mean" hint ----------------------------------------------------------
def test_typos_get_a_hint():
    _one_error(olv("genrate", "m.onnx"), "invalid choice: 'genrate'", "did you mean 'generate'?")
    _one_error(olv("generate", "m.onnx", "--prompt-ids", "1", "--output", "idz"),
               "did you mean 'ids'?")
    _one_error(olv("generate", "m.onnx", "--prompt-ids", "1", "--temprature", "1"),
               "unrecognized arguments: --temprature", "--temprature -> --temperature")
    line = _one_error(olv("generate", "m.onnx", "--prompt-ids", "1", "--zzzzzz"),
                      "unrecognized arguments: --zzzzzz")
    assert "did you mean" not in line


def test_option_of_another_command_is_named_not_suggested_as_itself():
    line = _one_error(olv("generate", "m.onnx", "--kv", "paged", "--prompt-ids", "1"),
                      "unrecognized arguments: --kv paged",
                      "--kv is an option of 'olv convert', not of this command",
                      "fixed when the model is converted")
    assert "--kv -> --kv" not in line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_model_path_that_is_not_a_regular_file(tmp_path):
    from olv_runtime.errors import ModelFormatError
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((os.devnull, "a character device"), (fifo, "a FIFO")):
        with pytest.raises(ModelFormatError, match=f"is not a regular file \\({kind}\\)"):
            olv_runtime.load(path)
        _one_error(olv("generate", path, "--prompt-ids", "1"), "is not a regular file", kind)
