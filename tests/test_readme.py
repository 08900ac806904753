"""Issue 26 item 7: the README's examples run as written.

Every fenced block in README.md is preceded by an HTML comment: ``<!-- readme-test: NAME -->``
(a test below extracts the block and runs it) or ``<!-- readme-not-run: REASON -->`` (an
install or benchmark command these tests cannot run here, with the reason);
:func:`test_every_readme_block_is_run_or_says_why_not` checks that no block is left out.

How the blocks run. Each test works in a fresh folder (``tmp_path``). Shell blocks run in bash
(``set -eo pipefail``) with ``olv`` and ``python`` on PATH being this checkout's CLI and this
interpreter (``PYTHONPATH`` = the checkout), ``bench/`` a link to the checkout's ``bench/``,
``TMPDIR`` the test folder; every command must exit 0 and print no traceback. Python blocks
run as written, in the process (``exec``) or, for the torch export, as a script. Transcript
blocks (lines after ``$ ``) run their ``$`` commands; their output is compared with the README's,
rates aside.

What the tests put in place of things a real user has (no download is possible here): the files
and folders a block names are *created* under those names (``path/to/Qwen2.5-0.5B-Instruct``,
``ckpt``, ``DIR`` and ``Qwen2.5-0.5B-Instruct`` by ``olv make-checkpoint``; the Q4_K_M GGUF by
tests/gguf_models.py; ``wiki.test.raw`` a short text), so the block's text is unchanged. Where
a text must change, :func:`substitute` replaces exact strings (each must occur) and the README
says so next to the block: Qwen's prompt ids by the tiny tokenizer's, the 0.5B checkpoint and
its vocabulary in the eval transcript by the tiny ones, and options appended to the benchmark
lines to keep them short.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib

import numpy as np
import pytest
from hostile import ROOT
from serve_process import free_port, wait_healthy
from tokenizers import Tokenizer

from olv_runtime.cli import main as cli_main


def readme_block(marker: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(re.escape(f"<!-- readme-test: {marker} -->") + r"\s*```[^\n]*\n(.*?)```",
                  text, re.DOTALL)
    assert m is not None, f"README.md has no block marked readme-test: {marker}"
    return [ln for ln in m.group(1).splitlines() if ln.strip()]


def run_line(line: str, monkeypatch) -> int:
    if line.startswith("python "):  # a repository script, run from the checkout
        words = shlex.split(line, comments=True)
        script = str(ROOT / words[1])
        boot = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); "  # this checkout's package
                "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
        r = subprocess.run([sys.executable, "-c", boot, str(ROOT), script, *words[2:]],
                           capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        return 0
    stdin = ""
    if "|" in line:
        left, line = (part.strip() for part in line.split("|", 1))
        words = shlex.split(left)
        assert words[0] == "echo", left
        stdin = " ".join(words[1:]) + "\n"
    words = shlex.split(line, comments=True)
    assert words[0] == "olv", line
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return cli_main(words[1:])


def test_tiny_checkpoint_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lines = readme_block("tiny")
    assert lines[0].startswith("olv make-checkpoint") and len(lines) >= 5
    for line in lines:
        rc = run_line(line, monkeypatch)
        _out, err = capsys.readouterr()
        assert rc == 0, (line, err[-2000:])
        assert "Traceback" not in err, (line, err)
    for name in ("tiny-ckpt/config.json", "tiny-ckpt/tokenizer.json",
                 "tiny-ckpt/tokenizer_config.json", "tiny.onnx", "tokenizer.json",
                 "chat.jsonl", "tiny-fast.onnx"):
        assert (tmp_path / name).is_file(), name
    turns = (tmp_path / "chat.jsonl").read_text().splitlines()
    assert len(turns) == 1
    assert "<|im_start|>user\nhello there<|im_end|>" in json.loads(turns[0])["rendered"]


def test_make_checkpoint_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert cli_main(["make-checkpoint", str(tmp_path / "x")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_tiny_gguf_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for line in readme_block("tiny")[:2] + readme_block("tiny-gguf"):  # make, convert, GGUF
        rc = run_line(line, monkeypatch)
        _out, err = capsys.readouterr()
        assert rc == 0, (line, err[-2000:])
    # the GGUF carries the real tokenizer: the prompt encodes to the same ids through both
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    back = Tokenizer.from_file(str(tmp_path / "tiny-gguf" / "tokenizer.json"))
    text = "The capital of France is"
    assert back.encode(text).ids == ours.encode(text).ids
    assert "chat_template" in json.loads(
        (tmp_path / "tiny-gguf" / "tokenizer_config.json").read_text())


def test_python_snippets_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's Python quickstart and continuation blocks, on olv make-checkpoint's model
    converted to qwen.onnx (tokenizer.json and the chat template beside it)."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "ckpt"]) == 0
    assert cli_main(["convert", "ckpt", "qwen.onnx"]) == 0
    capsys.readouterr()
    for marker in ("python-quickstart", "python-continue"):
        code = "\n".join(readme_block(marker))
        namespace: dict = {"__name__": "__readme__"}
        exec(compile(code, f"README.md:{marker}", "exec"), namespace)  # noqa: S102 - our README
    assert len(namespace["ids"]) == 32 and namespace["res"].finish_reason in ("length", "eos",
                                                                               "stop")
    assert namespace["conv"].state is not None


def test_cli_sampling_lines_run_in_bash(tmp_path, monkeypatch, capsys):
    """The README's stopping and sampling lines, each run by bash as written (its quoting,
    $'\\n' and $(cat long.txt) included), with ``olv`` this checkout's CLI and qwen.onnx the
    tiny model."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "ckpt"]) == 0
    assert cli_main(["convert", "ckpt", "qwen.onnx"]) == 0
    capsys.readouterr()
    (tmp_path / "long.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "olv"
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                    "from olv_runtime.cli import main\nsys.exit(main())\n")
    shim.chmod(0o755)
    lines = readme_block("cli-sampling")
    assert len(lines) >= 6
    for line in lines:
        r = subprocess.run(["bash", "-c", f'PATH={shlex.quote(str(bindir))}:"$PATH"; {line}'],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (line, r.stderr)
    assert (tmp_path / "long.npz").is_file()  # the prompt-cache line wrote its state


def test_compile_lines_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "ckpt"]) == 0
    assert cli_main(["convert", "ckpt", "out.onnx"]) == 0
    capsys.readouterr()
    for line in readme_block("compile"):
        assert run_line(line, monkeypatch) == 0, (line, capsys.readouterr().err[-2000:])
    out = capsys.readouterr().out
    assert (tmp_path / "fast.onnx.compiled").is_file() and "hit" in out


# --- every block, and the blocks the tests above do not run ------------------------------------

# the readme-test blocks and the tests that run them (checked against README.md below)
TESTED = {
    "setup-demo": "test_setup_blocks", "setup-tests": "test_setup_blocks",
    "tiny": "test_tiny_checkpoint_recipe_runs_as_written",
    "tiny-gguf": "test_tiny_gguf_recipe_runs_as_written",
    "quickstart": "test_real_checkpoint_quickstart",
    "python-quickstart": "test_python_snippets_run_as_written",
    "gguf-q4km": "test_gguf_q4_k_m_quickstart",
    "genai": "test_onnxruntime_genai_recipe",
    "torch-export": "test_torch_export_and_qdq_recipes", "qdq": "test_torch_export_and_qdq_recipes",
    "compile": "test_compile_lines_run_as_written",
    "chat-transcript": "test_chat_transcript",
    "cli-sampling": "test_cli_sampling_lines_run_in_bash",
    "python-continue": "test_python_snippets_run_as_written",
    "eval": "test_eval_block",
    "eval-transcript": "test_eval_transcript",
    "session-options": "test_session_options_and_encoded_values",
    "encoded-values": "test_session_options_and_encoded_values",
    "bench-decode": "test_bench_decode_lines",
    "bench-kernels": "test_bench_kernels_lines_select_benchmarks",
    "engine-python": "test_engine_python_block",
    "engine-cli": "test_engine_cli_block",
    "serve-start": "test_serving_blocks", "serve-curl": "test_serving_blocks",
    "serve-openai": "test_serving_blocks",
}
FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
MARK = re.compile(r"<!-- readme-(test|not-run): ([^\n]*?) -->\s*$")


def test_every_readme_block_is_run_or_says_why_not():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    seen, unmarked = [], []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        mark = MARK.search(text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1] + "\n")
        if mark is None:
            unmarked.append(f"README.md:{line}: {m.group(0).splitlines()[1][:60]!r}")
        elif mark.group(1) == "test":
            seen.append(mark.group(2))
        else:
            assert len(mark.group(2).split()) >= 4, f"README.md:{line}: say why it is not run"
    assert not unmarked, "blocks neither run by tests/test_readme.py nor marked readme-not-run:\n" \
        + "\n".join(unmarked)
    assert len(seen) == len(set(seen)), seen
    assert set(seen) == set(TESTED), (set(seen) ^ set(TESTED))
    here = pathlib.Path(__file__).read_text()
    for name in set(TESTED.values()):
        assert f"def {name}(" in here, name


def substitute(text: str, replacements: dict[str, str]) -> str:
    """``text`` with each key replaced by its value; each key must occur (a README edit that
    drops it must come back here)."""
    for old, new in replacements.items():
        assert old in text, f"{old!r} is no longer in the README block"
        text = text.replace(old, new)
    return text


def shell_env(folder: pathlib.Path) -> dict:
    """bash's environment for README blocks: ``olv`` and ``python`` this checkout's, bench/ the
    checkout's, TMPDIR and the bench cache inside the test folder."""
    bindir = folder / ".bin"
    bindir.mkdir()
    (bindir / "olv").write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                                "from olv_runtime.cli import main\nsys.exit(main())\n")
    (bindir / "olv").chmod(0o755)
    (bindir / "python").symlink_to(sys.executable)
    if not (folder / "bench").exists():
        (folder / "bench").symlink_to(ROOT / "bench")
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
                TMPDIR=str(folder), OLV_BENCH_CACHE=str(folder / ".bench-cache"))


def run_bash(script: str, folder: pathlib.Path, env: dict, timeout: float = 600,
             merge: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], cwd=folder, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                       text=True, timeout=timeout, check=False)
    assert r.returncode == 0, (script, r.stdout[-2000:], (r.stderr or "")[-3000:])
    assert "Traceback" not in r.stdout + (r.stderr or ""), (script, r.stderr)
    return r


def block_text(marker: str) -> str:
    return "\n".join(readme_block(marker)) + "\n"


def make_checkpoint(folder: pathlib.Path) -> pathlib.Path:
    assert cli_main(["make-checkpoint", str(folder)]) == 0
    return folder


def extras() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def check_pip_install(command: str) -> None:
    """A README ``pip install`` of this checkout: the path is the checkout (run from its root)
    and every extra it names exists in pyproject.toml. Not run: the tests run on the installed
    package."""
    words = shlex.split(command)
    assert words[:3] == ["pip", "install", "-e"] and len(words) == 4, command
    m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[3])
    assert m is not None and (ROOT / "pyproject.toml").is_file(), command
    for extra in (m.group(1) or "").split(","):
        assert not extra or extra in extras(), (command, extra, sorted(extras()))


def test_setup_blocks(tmp_path):
    """``pip install -e . && olv demo``: the install line is checked (see check_pip_install) and
    ``olv demo`` runs; ``pip install -e ".[test]" && pytest``: the extra exists, and ``pytest``
    with no arguments collects tests/ -- the suite this test is part of."""
    env = shell_env(tmp_path)
    (demo,) = readme_block("setup-demo")
    install, run = (part.strip() for part in demo.split("&&"))
    check_pip_install(install)
    assert run == "olv demo"
    out = run_bash(run, tmp_path, env, merge=True).stdout  # the timings are on stderr
    assert "[3/3] generating 32 tokens" in out and "first token" in out, out[-2000:]
    (tests,) = readme_block("setup-tests")
    install, run = (part.strip() for part in tests.split("&&"))
    check_pip_install(install)
    assert run == "pytest"
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert pytest_ini["testpaths"] == ["tests"] and pathlib.Path(__file__).parent == ROOT / "tests"
    for dep in ("pytest", "torch==2.13.0", "transformers", "onnxruntime", "gguf", "matplotlib"):
        assert any(d.replace(" ", "").startswith(dep) for d in extras()["test"]), dep


def tiny_ids(checkpoint: pathlib.Path, text: str) -> str:
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids
    assert ids
    return ",".join(map(str, ids))


def test_real_checkpoint_quickstart(tmp_path):
    env = shell_env(tmp_path)
    ckpt = make_checkpoint(tmp_path / "path" / "to" / "Qwen2.5-0.5B-Instruct")
    script = substitute(block_text("quickstart"),
                        {"785,6722,315": tiny_ids(ckpt, "The capital of France")})
    out = run_bash(script, tmp_path, env).stdout
    assert (tmp_path / "qwen.onnx").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert out.count("The capital of France is") == 1  # the --prompt run (--prompt-ids: no echo)
    assert len(re.findall(r"^prefill [\d.]+ tok/s, decode [\d.]+ tok/s \(median of 3\)", out,
                          re.MULTILINE)) == 2  # the two olv bench lines
    assert "olv::Decode x" in out and "compiled tensors:" in out  # olv inspect -v


def test_gguf_q4_k_m_quickstart(tmp_path):
    import gguf_models

    env = shell_env(tmp_path)
    name = "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"
    script = block_text("gguf-q4km")
    assert name in script
    gguf_models.write_gguf(tmp_path / name, "qwen2", "Q4_K", embd_type="Q6_K", hidden=256,
                           inter=512)
    out = run_bash(script, tmp_path, env).stdout
    assert "(512, 256)" in out  # decode_value of up_proj: [intermediate, hidden]
    assert (tmp_path / "std.onnx").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert "GGUF tensors referenced in place, 0 bytes copied" in out
    assert "\nThe capital of France is" in out


def test_onnxruntime_genai_recipe(tmp_path):
    env = shell_env(tmp_path)
    ckpt = make_checkpoint(tmp_path / "Qwen2.5-0.5B-Instruct")
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    out = run_bash(block_text("genai"), tmp_path, env).stdout
    assert (tmp_path / "qwen-genai" / "genai_config.json").is_file()
    assert f"(1, 3, {vocab})" in out
    assert "The capital of France is" in out
    assert re.search(r"^prefill [\d.]+ tok/s, decode [\d.]+ tok/s", out, re.MULTILINE), out[-2000:]


def test_torch_export_and_qdq_recipes(tmp_path, monkeypatch):
    import onnx
    import onnxruntime

    import olv_runtime

    env = shell_env(tmp_path)
    make_checkpoint(tmp_path / "path" / "to" / "Qwen2.5-0.5B-Instruct")
    (tmp_path / "export.py").write_text(block_text("torch-export"))
    run_bash("python export.py", tmp_path, env)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(block_text("qdq"), "README.md:qdq", "exec"), namespace)  # noqa: S102 - our README
    ops = [n.op_type for n in onnx.load("qwen2_qdq.onnx").graph.node]
    assert ops.count("DequantizeLinear") >= 4 * 7, ops  # 4 layers x q, k, v, o, gate, up, down
    kinds = [k for k, _ in namespace["steps"]]
    assert "DequantizeLinear" not in kinds and kinds.count("Linear") >= 4 * 4
    ids = {"input_ids": np.array([[5, 6, 7, 8, 9]], dtype=np.int64)}
    (got,) = olv_runtime.InferenceSession("qwen2_qdq.onnx").run(None, ids)
    so = onnxruntime.SessionOptions()  # its QDQ -> MatMulNBits fusion with float activations
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    (ref,) = onnxruntime.InferenceSession("qwen2_qdq.onnx", so,
                                          providers=["CPUExecutionProvider"]).run(None, ids)
    vocab = json.loads((tmp_path / "path/to/Qwen2.5-0.5B-Instruct/config.json").read_text())
    assert got.shape == ref.shape == (1, 5, vocab["vocab_size"])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


RATE = re.compile(r"[\d.]+ tok/s")


def transcript(marker: str) -> tuple[list[str], list[list[str]]]:
    """The ``$`` commands of a transcript block and the output lines after each."""
    commands, outputs = [], []
    for line in readme_block(marker):
        if line.startswith("$ "):
            commands.append(line[2:])
            outputs.append([])
        else:
            outputs[-1].append(line)
    return commands, outputs


def test_chat_transcript(tmp_path):
    env = shell_env(tmp_path)
    make_checkpoint(tmp_path / "tiny-ckpt")
    assert cli_main(["convert", str(tmp_path / "tiny-ckpt"), str(tmp_path / "tiny.onnx")]) == 0
    (command,), (expected,) = transcript("chat-transcript")
    got = run_bash(command, tmp_path, env, merge=True).stdout.splitlines()
    assert [RATE.sub("# tok/s", ln) for ln in got] == [RATE.sub("# tok/s", ln) for ln in expected]
    assert len((tmp_path / "chat.jsonl").read_text().splitlines()) == 2


def test_eval_block(tmp_path):
    env = shell_env(tmp_path)
    make_checkpoint(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "path" / "to" / "hf-checkpoint")
    words = ["the", "capital", "of", "france", "is", "paris", "and", "the", "capital", "of", "italy", "is", "rome"]
    rng = np.random.default_rng(0)
    (tmp_path / "wiki.test.raw").write_text(" ".join(rng.choice(words, 80)) + "\n")
    script = block_text("eval")
    m = re.search(r"pip install '(\w+)\[(\w+)\]'", script)
    assert m and m.group(1) == "olv_runtime" and m.group(2) in extras()
    assert {"torch", "transformers"} <= {re.split(r"[<>=]", d)[0] for d in extras()[m.group(2)]}
    out = run_bash(script, tmp_path, env).stdout
    report = json.loads((tmp_path / "kl.json").read_text())
    assert report and (tmp_path / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refs = [float(x) for x in re.findall(r"^PPL\(reference\)\s+([\d.]+)", out, re.MULTILINE)]
    models = [float(x) for x in re.findall(r"^PPL\(model\)\s+([\d.]+)", out, re.MULTILINE)]
    assert len(refs) == 2 and len(models) == 2, out
    # the float32 olv model and transformers on the same checkpoint give the same reference
    assert models[0] == models[1] and abs(refs[0] / refs[1] - 1) < 1e-3, out


def label(line: str) -> str:
    """A report line's label: the text before its first run of two spaces, numbers as #."""
    return re.sub(r"\d+(?:\.\d+)?", "#", re.split(r"\s{2,}", line.strip())[0])


def test_eval_transcript(tmp_path):
    """The recorded run's commands, on the tiny model instead of bench/make_checkpoint.py's
    0.5B-shaped one (20 minutes there): the report has the README's lines, in its order."""
    env = shell_env(tmp_path)
    commands, outputs = transcript("eval-transcript")
    vocab = 386
    script = substitute("\n".join(commands), {"python bench/make_checkpoint.py": "olv make-checkpoint",
                                              "151936": str(vocab), "4097": "257"})
    out = run_bash(script, tmp_path, env).stdout
    assert json.loads((tmp_path / "ckpt05" / "config.json").read_text())["vocab_size"] == vocab
    assert (tmp_path / "eval.json").is_file()
    report = out[out.index("model "):].splitlines()
    expected = [ln for ln in outputs[-1] if not ln.startswith("eval: ")]  # the progress bar
    assert [label(ln) for ln in report if ln.strip()] == [label(ln) for ln in expected if ln.strip()]


def test_session_options_and_encoded_values(tmp_path, monkeypatch):
    import numba

    import olv_runtime

    monkeypatch.chdir(tmp_path)
    make_checkpoint(tmp_path / "ckpt")
    assert cli_main(["convert", "ckpt", "qwen.onnx"]) == 0
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    threads = numba.get_num_threads()
    try:
        ns: dict = {"__name__": "__readme__"}
        exec(compile(block_text("session-options"), "README.md:session-options", "exec"), ns)  # noqa: S102
    finally:
        numba.set_num_threads(threads)
    assert isinstance(ns["sess"], olv_runtime.InferenceSession)
    assert ns["sess"].options.num_threads == 2 and ns["sess"].options.kv_initial_capacity == 256
    ns = {"__name__": "__readme__"}
    exec(compile(block_text("encoded-values"), "README.md:encoded-values", "exec"), ns)  # noqa: S102
    assert ns["w"].shape == (cfg["hidden_size"], cfg["intermediate_size"])
    ids = {"input_ids": np.array([[3, 4, 5]], dtype=np.int64)}
    a, b = (olv_runtime.make_state(s, olv_runtime.empty_cache(s)).run(ids)["logits"]
            for s in (olv_runtime.InferenceSession(ns[k]) for k in ("model", "dense")))
    assert a.shape == b.shape and np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(b).max())


BENCH_SMALL = "--runs 1 --prefill-lens 32 --backends olv --no-ttft --no-overhead --paged '' " \
              "--wait-idle 0 --retry-busy 0"


def test_bench_decode_lines(tmp_path):
    """bench/decode.py on the tiny checkpoint (as DIR) and its conversion (out.onnx), with the
    options the README names appended (BENCH_SMALL: one run, the olv row, no cold start)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`" + BENCH_SMALL + "`" in " ".join(text.split())  # the README says what is appended
    env = shell_env(tmp_path)
    make_checkpoint(tmp_path / "DIR")
    assert cli_main(["convert", str(tmp_path / "DIR"), str(tmp_path / "out.onnx")]) == 0
    lines = readme_block("bench-decode")
    assert len(lines) == 2
    for line in lines:
        r = run_bash(f"{line} {BENCH_SMALL}", tmp_path, env)
        row = re.search(r"^\| olv_runtime exact \(fp32 activations\) \| ([\d.]+) ", r.stdout, re.MULTILINE)
        assert row and float(row.group(1)) > 0, (line, r.stdout[-3000:], r.stderr[-3000:])


def test_bench_kernels_lines_select_benchmarks(tmp_path):
    """Each pytest-benchmark line, collected only (the measurements take minutes): the file and
    the -k expression still select benchmarks. Run in the test folder (bench/ linked), where
    pytest-benchmark makes its storage folder."""
    env = shell_env(tmp_path)
    for line in readme_block("bench-kernels"):
        words = shlex.split(line, comments=True)
        if not words:  # a comment continuing the line above
            continue
        assert words[:2] == ["pytest", "bench/bench_kernels.py"], line
        r = subprocess.run([sys.executable, "-m", *words, "--collect-only", "-q",
                            "-p", "no:cacheprovider"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300, check=False)
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
        selected = [ln for ln in r.stdout.splitlines() if "::test_" in ln]
        assert selected, (line, r.stdout[-2000:])


# --- the batching engine (issue 23) ---------------------------------------------------------
@pytest.fixture(scope="module")
def engine_workdir(tmp_path_factory):
    """olv make-checkpoint's model converted to qwen.onnx (made once for both blocks)."""
    d = tmp_path_factory.mktemp("readme_engine")
    assert cli_main(["make-checkpoint", str(d / "ckpt")]) == 0
    assert cli_main(["convert", str(d / "ckpt"), str(d / "qwen.onnx")]) == 0
    return d


def test_engine_python_block(engine_workdir, monkeypatch, capsys):
    monkeypatch.chdir(engine_workdir)
    capsys.readouterr()
    code = "\n".join(readme_block("engine-python"))
    ns: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md:engine-python", "exec"), ns)  # noqa: S102 - our README
    results = ns["results"]
    assert len(results) == 3 and all(r.finish_reason in ("length", "eos") for r in results)
    assert all(r.error is None and r.ids.size >= 1 for r in results)
    out = capsys.readouterr().out
    assert out.count("length") + out.count("eos") >= 4
    st = ns["engine"].stats()
    assert st.finished == 4 and st.blocks_used == 0 and ns["engine"].batched


def test_engine_cli_block(engine_workdir, monkeypatch, capsys):
    tmp_path = engine_workdir
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    lines = readme_block("engine-cli")
    assert lines[0].startswith("printf ")
    (tmp_path / "prompts.txt").write_text("The capital of France is\nOnce upon a time\n")
    for line in lines[1:]:
        words = shlex.split(line)
        out_file = None
        if ">" in words:
            i = words.index(">")
            out_file, words = words[i + 1], words[:i]
        assert words[0] == "olv", line
        assert cli_main(words[1:]) == 0, (line, capsys.readouterr().err[-2000:])
        out, _ = capsys.readouterr()
        if out_file:
            (tmp_path / out_file).write_text(out)
    recs = [json.loads(ln) for ln in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1]
    assert all(len(r["ids"]) >= 1 and r["finish_reason"] in ("length", "eos") for r in recs)


# --- olv serve (issue 24) -----------------------------------------------------------------------
def test_serving_blocks(tmp_path):
    """``olv serve tiny.onnx ...`` started as written on a free loopback port (the README's 8000
    replaced by it, here and in the curl lines and the openai snippet), the curl lines run in
    bash, the openai-client snippet in the process; then SIGTERM: exit status 0."""
    pytest.importorskip("httpx")  # the test extra has them (olv serve's clients)
    pytest.importorskip("openai")
    env = shell_env(tmp_path)
    assert cli_main(["make-checkpoint", str(tmp_path / "tiny-ckpt")]) == 0
    assert cli_main(["convert", str(tmp_path / "tiny-ckpt"), str(tmp_path / "tiny.onnx")]) == 0
    port = free_port()
    (start,) = readme_block("serve-start")
    start = substitute(start, {"--port 8000": f"--port {port}"})
    proc = subprocess.Popen(["bash", "-c", "exec " + start + " --log-level warning"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 180)
        outs = [run_bash(line.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), tmp_path,
                         env).stdout for line in readme_block("serve-curl")]
        assert json.loads(outs[0]) == {"status": "ok"}
        assert json.loads(outs[1])["data"][0]["id"] == "tiny.onnx"
        assert json.loads(outs[2])["usage"]["completion_tokens"] <= 8
        assert outs[3].rstrip().endswith("data: [DONE]")
        assert "olv_kv_blocks_total" in outs[4]
        code = substitute(block_text("serve-openai"), {"127.0.0.1:8000": f"127.0.0.1:{port}"})
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "README.md:serve-openai", "exec"),  # noqa: S102 - our README
                 {"__name__": "__readme__"})
        assert set(json.loads(buf.getvalue().rstrip().splitlines()[-1])) == {"city", "rank"}
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, proc.stderr.read()[-2000:]
