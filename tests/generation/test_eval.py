"""olv eval / olv_runtime.generation.evaluate: the tiny Qwen2 INT4 model against its float32 conversion,
checked against an independent numpy computation from both models' logits (one-shot stateless
runs per window, logsumexp by np.logaddexp.reduce)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import olv_runtime
from olv_runtime.cli import main as cli_main
from olv_runtime.errors import InvalidArgument
from olv_runtime.generation.evaluate import evaluate, read_tokens

CTX, STRIDE, BATCH, N = 64, 40, 24, 203


@pytest.fixture(scope="module")
def tokens(tiny_chat_models):
    vocab = int(olv_runtime.load(tiny_chat_models["int4"]).metadata()["olv.vocab_size"])
    return np.random.default_rng(5).integers(0, vocab, N)


def one_shot_logits(path, window):
    sess = olv_runtime.InferenceSession(olv_runtime.load(path))
    feeds = {"input_ids": np.asarray([window], np.int64), **olv_runtime.empty_cache(sess)}
    return sess.run(["logits"], feeds)[0][0].astype(np.float64)


def independent(tiny_chat_models, tokens):
    """Per-target (position, nll_q, nll_ref, kl, top1) with the HF sliding-window rule."""
    rows = {}
    for begin in range(0, N, STRIDE):
        end = min(begin + CTX, N)
        win = tokens[begin:end]
        zq = one_shot_logits(tiny_chat_models["int4"], win)
        zb = one_shot_logits(tiny_chat_models["float32"], win)
        for t in range(begin + 1, end):
            if t in rows:
                continue
            q, b = zq[t - begin - 1], zb[t - begin - 1]
            lq = q - np.logaddexp.reduce(q)
            lb = b - np.logaddexp.reduce(b)
            kl = float(np.sum(np.exp(lb) * (lb - lq)))
            rows[t] = (-lq[tokens[t]], -lb[tokens[t]], kl, int(np.argmax(q) == np.argmax(b)))
        if end == N:
            break
    pos = sorted(rows)
    return np.array(pos), np.array([rows[p] for p in pos])


def test_kl_divergence_equals_independent_numpy(tiny_chat_models, tokens):
    res = evaluate(tiny_chat_models["int4"], tokens, tiny_chat_models["float32"], ctx=CTX,
                   stride=STRIDE, batch=BATCH, progress=False)
    pos, ref = independent(tiny_chat_models, tokens)
    assert res.positions.tolist() == pos.tolist() == list(range(1, N))
    np.testing.assert_allclose(res.nll, ref[:, 0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(res.ref_nll, ref[:, 1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(res.kld, ref[:, 2], rtol=0, atol=1e-6)
    s = res.summary()
    assert abs(s["kld_mean"] - ref[:, 2].mean()) < 1e-6
    assert abs(s["kld_median"] - np.median(ref[:, 2])) < 1e-6
    assert abs(s["kld_p99"] - np.percentile(ref[:, 2], 99)) < 1e-6
    assert s["top1_agree_count"] == int(ref[:, 3].sum())
    assert s["kld_mean"] > 0  # INT4 differs from float32
    assert abs(s["ppl"] - np.exp(ref[:, 0].mean())) < 1e-4 * s["ppl"]
    assert abs(s["delta_ppl"] - (np.exp(ref[:, 0].mean()) - np.exp(ref[:, 1].mean()))) < 1e-3
    # the model against itself: zero divergence, full agreement
    same = evaluate(tiny_chat_models["int4"], tokens, tiny_chat_models["int4"], ctx=CTX,
                    stride=STRIDE, batch=BATCH, progress=False).summary()
    assert same["kld_max"] < 1e-9 and same["top1_agreement"] == 1.0 and abs(same["delta_ppl"]) < 1e-9


def test_transformers_reference(tiny_chat_models, tiny_chat_dir, tokens):
    a = evaluate(tiny_chat_models["int4"], tokens[:120], tiny_chat_models["float32"], ctx=CTX,
                 stride=STRIDE, batch=BATCH, progress=False)
    b = evaluate(tiny_chat_models["int4"], tokens[:120], tiny_chat_dir, ctx=CTX,
                 stride=STRIDE, batch=BATCH, progress=False)
    # the float32 conversion matches transformers (logits within 1e-4): the same divergences
    np.testing.assert_allclose(b.kld, a.kld, rtol=1e-2, atol=1e-6)
    assert b.summary()["top1_agree_count"] == a.summary()["top1_agree_count"]


def test_cli_eval(tiny_chat_models, tokens, tmp_path, capsys):
    ids = tmp_path / "tokens.ids"
    ids.write_text(" ".join(map(str, tokens.tolist())))
    out = tmp_path / "s.json"
    assert cli_main(["eval", str(tiny_chat_models["int4"]), "--token-ids", str(ids),
                     "--reference", str(tiny_chat_models["float32"]), "--ctx", str(CTX),
                     "--stride", str(STRIDE), "--batch", str(BATCH), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "KLD mean" in text and "same top-1 token" in text and "PPL(reference)" in text
    s = json.loads(out.read_text())
    _, ref = independent(tiny_chat_models, tokens)
    assert abs(s["kld_mean"] - ref[:, 2].mean()) < 1e-6
    assert s["top1_agree_count"] == int(ref[:, 3].sum()) and s["tokens"] == N - 1
    # perplexity only, over a text file
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 6)
    assert cli_main(["eval", str(tiny_chat_models["int4"]), "--file", str(tmp_path / "t.txt"),
                     "--ctx", "32"]) == 0
    assert "PPL(model)" in capsys.readouterr().out


def test_eval_errors(tiny_chat_models, tmp_path):
    m = tiny_chat_models["int4"]
    with pytest.raises(InvalidArgument, match="at least 2"):
        evaluate(m, [1], progress=False)
    with pytest.raises(InvalidArgument, match="stride"):
        evaluate(m, [1, 2, 3], ctx=8, stride=9, progress=False)
    with pytest.raises(InvalidArgument, match=r"ids must be in \[0, "):
        evaluate(m, [1, 10**6], progress=False)
    (tmp_path / "bad.ids").write_text("1 2 x")
    with pytest.raises(InvalidArgument, match="got item 'x'"):
        read_tokens(tmp_path / "bad.ids", token_ids=True)


def test_paged_int8_kv_against_contiguous(tiny_chat_dir, tiny_chat_models, tokens, tmp_path):
    """One use of --reference: a paged INT8 KV cache against the contiguous cache of the same
    weights (the INT8 KV rounding is the only difference)."""
    paged = tmp_path / "paged.onnx"
    olv_runtime.convert(tiny_chat_dir, paged, kv="paged-int8")
    res = evaluate(paged, tokens[:100], tiny_chat_models["int4"], ctx=CTX, stride=STRIDE,
                   batch=BATCH, progress=False)
    s = res.summary()
    assert 0 < s["kld_mean"] < 1e-3 and s["top1_agreement"] > 0.9
    # a paged KV state cannot be saved as a prompt cache: a clear error, no file
    from olv_runtime.errors import StateError

    _, state = olv_runtime.generate(paged, [1, 2, 3], 2, return_state=True)
    with pytest.raises(StateError, match="paged KV cache"):
        state.save(tmp_path / "p.npz")
    assert not (tmp_path / "p.npz").exists()


def test_cli_plot(tiny_chat_models, tokens, tmp_path, capsys):
    ids = tmp_path / "tokens.ids"
    ids.write_text(" ".join(map(str, tokens[:60].tolist())))
    png = tmp_path / "kl.png"
    base = ["eval", str(tiny_chat_models["int4"]), "--token-ids", str(ids), "--ctx", "32",
            "--plot", str(png)]
    assert cli_main(base) == 2  # no reference: nothing to plot
    assert "--plot needs --reference" in capsys.readouterr().err
    rc = cli_main(base + ["--reference", str(tiny_chat_models["float32"])])
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # matplotlib is optional: a clear error
        assert rc == 2 and "--plot needs matplotlib" in capsys.readouterr().err
    else:
        assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib_fails_before_evaluating(tiny_chat_models, tokens, tmp_path,
                                                            capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    ids = tmp_path / "tokens.ids"
    ids.write_text(" ".join(map(str, tokens[:60].tolist())))
    out = tmp_path / "eval.json"
    rc = cli_main(["eval", str(tiny_chat_models["int4"]), "--token-ids", str(ids), "--ctx", "32",
                   "--reference", str(tiny_chat_models["float32"]), "--json", str(out),
                   "--plot", str(tmp_path / "kl.png")])
    assert rc == 2 and "--plot needs matplotlib" in capsys.readouterr().err
    assert not out.exists()  # nothing was evaluated
