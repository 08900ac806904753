"""Perplexity and encoded-vs-reference comparison over a token sequence (``olv eval``).

The sequence is scored with a sliding window (the Hugging Face "Perplexity of fixed-length
models" procedure): windows of ``ctx`` tokens start every ``stride`` tokens; each window is run
from an empty KV cache and scores only the targets the previous window did not reach, so every
token after the first is scored once, with at least ``ctx - stride`` tokens of context (except
in the first window). Windows are prefilled in chunks of ``batch`` tokens through the persistent
state (the KV cache carried between chunks), so logits are materialized ``batch`` rows at a
time.

With a reference model (another olv model — e.g. the float32 conversion of the same
checkpoint, or a contiguous-KV build — or a Hugging Face checkpoint run through transformers),
every scored position also gets the KL divergence ``KL(P_ref || P_model) = sum_v p_ref(v)
(log p_ref(v) - log p_model(v))`` of the next-token distributions, and whether both models'
most likely tokens agree: the statistics llama.cpp's ``llama-perplexity --kl-divergence``
reports (mean with its standard error, median, percentiles, maximum; perplexities of both,
their ratio and difference with error estimates; top-1 agreement). Arithmetic is float64 on the
float32 logits.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
from typing import Any, Callable

import numpy as np

from olv_runtime.errors import InvalidArgument, MissingDependencyError
from olv_runtime.executor.session import InferenceSession
from olv_runtime.io import read_npy_header
from olv_runtime.progress import bar
from olv_runtime.state import empty_cache, make_state


# -- logit sources ------------------------------------------------------------------------------
class OlvLogits:
    """Logits of an olv model, chunk by chunk through a persistent state.

    Parameters
    ----------
    model : Model, path or InferenceSession
    session_options : SessionOptions, optional
    """

    def __init__(self, model, session_options=None):
        self.session = model if isinstance(model, InferenceSession) else \
            InferenceSession(model, session_options)
        self.state = None
        v = self.session.get_modelmeta().get("olv.vocab_size")
        self.vocab = int(v) if v is not None else None
        self.name = str(getattr(self.session.model, "path", None) or "olv model")

    def start(self) -> None:
        """Begin a window: an empty KV cache."""
        if self.state is None:
            self.state = make_state(self.session, empty_cache(self.session))
        else:
            self.state.reset(empty_cache(self.session))

    def run(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[len(ids), vocab]`` logits of the next chunk of the window."""
        return self.state.run({"input_ids": np.asarray(ids, np.int64).reshape(1, -1)})["logits"][0]

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


class TransformersLogits:
    """Logits of a Hugging Face checkpoint run through transformers (float32, CPU), chunk by
    chunk with its KV cache (``past_key_values``).

    Parameters
    ----------
    checkpoint : path or transformers PreTrainedModel
    """

    def __init__(self, checkpoint):
        try:  # optional: the 'reference' extra
            import torch
            import transformers
        except ImportError as exc:
            raise MissingDependencyError(
                f"reference {checkpoint}: a Hugging Face checkpoint reference runs through "
                f"transformers on torch, which are not installed ({exc.name or exc}); install "
                "them with: pip install 'olv_runtime[reference]' (or pass an olv .onnx model "
                "as the reference)") from None
        self.torch = torch
        if isinstance(checkpoint, (str, pathlib.Path)):
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(checkpoint), dtype=torch.float32).eval()
            self.name = str(checkpoint)
        else:
            self.model, self.name = checkpoint, type(checkpoint).__name__
        self.vocab = int(self.model.config.vocab_size)
        self.past = None

    def start(self) -> None:
        self.past = None

    def run(self, ids: np.ndarray) -> np.ndarray:
        torch = self.torch
        # transformers >= 5.2x names the KV cache argument/output ``cache`` (``past_key_values``
        # before)
        if not hasattr(self, "_key"):
            params = inspect.signature(self.model.forward).parameters
            self._key = "cache" if "cache" in params else "past_key_values"
        with torch.no_grad():
            out = self.model(input_ids=torch.as_tensor(np.asarray(ids, np.int64)).reshape(1, -1),
                             use_cache=True, **{self._key: self.past})
        self.past = getattr(out, self._key)
        return out.logits[0].float().numpy()

    def close(self) -> None:
        self.past = None


def logit_source(model, session_options=None):
    """An :class:`OlvLogits` or :class:`TransformersLogits` for ``model``.

    A directory with ``config.json`` (and no .onnx given) or a transformers model object is run
    through transformers; an ``.onnx`` path, Model or InferenceSession through olv_runtime.
    """
    if isinstance(model, (OlvLogits, TransformersLogits)):
        return model
    if isinstance(model, (str, pathlib.Path)) and pathlib.Path(model).is_dir():
        if not (pathlib.Path(model) / "config.json").is_file():
            raise InvalidArgument(f"reference {model}: a directory without config.json")
        return TransformersLogits(model)
    if type(model).__module__.startswith("transformers"):
        return TransformersLogits(model)
    return OlvLogits(model, session_options)


# -- the evaluation ---------------------------------------------------------------------------
def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def windows(n_tokens: int, ctx: int, stride: int):
    """The sliding windows: ``(begin, end, first_target)`` with targets ``[first_target, end)``.

    Every position ``1 .. n_tokens-1`` is a target exactly once (position 0 has no context).
    """
    prev_end = 0
    begin = 0
    while True:
        end = min(begin + ctx, n_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            yield begin, end, first
        prev_end = end
        if end >= n_tokens:
            return
        begin += stride


@dataclasses.dataclass
class EvalResult:
    """Per-token figures of :func:`evaluate` (arrays ``[n_scored]``, in sequence order).

    Attributes
    ----------
    positions : numpy.ndarray
        int64 position of each scored (target) token in the sequence.
    nll : numpy.ndarray
        float64 ``-log p_model(target)`` (nats).
    ref_nll, kld : numpy.ndarray or None
        float64 ``-log p_ref(target)``; ``KL(P_ref || P_model)`` (nats). None without reference.
    top1 : numpy.ndarray or None
        bool: the two models' argmax tokens agree.
    ctx, stride, batch : int
    model_name, reference_name : str
    """

    positions: np.ndarray
    nll: np.ndarray
    ref_nll: np.ndarray | None
    kld: np.ndarray | None
    top1: np.ndarray | None
    ctx: int
    stride: int
    batch: int
    model_name: str = ""
    reference_name: str | None = None

    @property
    def tokens(self) -> int:
        return int(self.nll.size)

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))

    def summary(self) -> dict[str, Any]:
        """The statistics (``llama-perplexity --kl-divergence`` figures).

        Keys: ``tokens``, ``ppl`` / ``ppl_err`` (model); with a reference also ``ref_ppl`` /
        ``ref_ppl_err``, ``ln_ppl_ratio`` / ``_err`` (mean of ``nll - ref_nll``),
        ``ppl_ratio`` / ``_err``, ``delta_ppl`` / ``_err`` (``ppl - ref_ppl``, delta method
        with the covariance of the two nll series), ``nll_correlation``, ``kld_mean`` /
        ``kld_mean_err`` (standard error), ``kld_median``, ``kld_p90``, ``kld_p99``,
        ``kld_p99_9``, ``kld_max``, ``kld_min`` with ``kld_median_err`` / ``kld_p99_err`` (half
        width of the 95 % order-statistic interval), ``top1_agreement`` / ``_err`` (fraction,
        binomial standard error) and ``top1_agree_count``.
        """
        n = self.tokens
        if n < 2:
            raise InvalidArgument(f"statistics need at least 2 scored tokens, got {n}")
        out: dict[str, Any] = {"tokens": n}
        nll = self.nll
        m, se = nll.mean(), nll.std(ddof=1) / math.sqrt(n)
        ppl = math.exp(m)
        out.update(ppl=ppl, ppl_err=ppl * se)
        if self.kld is None:
            return out
        ref = self.ref_nll
        mr, ser = ref.mean(), ref.std(ddof=1) / math.sqrt(n)
        ppl_r = math.exp(mr)
        d = nll - ref
        md, sed = d.mean(), d.std(ddof=1) / math.sqrt(n)
        cov = np.cov(nll, ref, ddof=1)[0, 1] / n
        dvar = ppl * ppl * se * se + ppl_r * ppl_r * ser * ser - 2 * ppl * ppl_r * cov
        corr = float(np.corrcoef(nll, ref)[0, 1]) if nll.std() > 0 and ref.std() > 0 else 1.0
        out.update(ref_ppl=ppl_r, ref_ppl_err=ppl_r * ser, ln_ppl_ratio=md, ln_ppl_ratio_err=sed,
                   ppl_ratio=math.exp(md), ppl_ratio_err=math.exp(md) * sed,
                   delta_ppl=ppl - ppl_r, delta_ppl_err=math.sqrt(max(dvar, 0.0)),
                   nll_correlation=corr)
        k = self.kld
        s = np.sort(k)

        def quantile_err(q):
            half = 1.96 * math.sqrt(n * q * (1 - q))
            lo = s[max(int(math.floor(q * (n - 1) - half)), 0)]
            hi = s[min(int(math.ceil(q * (n - 1) + half)), n - 1)]
            return float(hi - lo) / 2

        out.update(kld_mean=float(k.mean()), kld_mean_err=float(k.std(ddof=1) / math.sqrt(n)),
                   kld_median=float(np.median(k)), kld_median_err=quantile_err(0.5),
                   kld_p90=float(np.percentile(k, 90)), kld_p99=float(np.percentile(k, 99)),
                   kld_p99_err=quantile_err(0.99), kld_p99_9=float(np.percentile(k, 99.9)),
                   kld_max=float(s[-1]), kld_min=float(s[0]))
        agree = int(self.top1.sum())
        p = agree / n
        out.update(top1_agree_count=agree, top1_agreement=p,
                   top1_agreement_err=math.sqrt(p * (1 - p) / (n - 1)))
        return out

    def table(self) -> str:
        """The summary as a printable table."""
        s = self.summary()
        lines = [f"model      {self.model_name}"]
        if self.reference_name:
            lines.append(f"reference  {self.reference_name}")
        lines.append(f"scored {s['tokens']} tokens (window {self.ctx}, stride {self.stride}, "
                     f"chunk {self.batch})")
        lines.append("")
        lines.append(f"{'PPL(model)':<28}{s['ppl']:14.6f} ± {s['ppl_err']:.6f}")
        if "kld_mean" in s:
            pct = 100 * s["top1_agreement"]
            rows = [
                ("PPL(reference)", s["ref_ppl"], s["ref_ppl_err"]),
                ("ΔPPL = PPL(model)-PPL(ref)", s["delta_ppl"], s["delta_ppl_err"]),
                ("PPL(model)/PPL(ref)", s["ppl_ratio"], s["ppl_ratio_err"]),
                ("mean ln(PPL ratio)", s["ln_ppl_ratio"], s["ln_ppl_ratio_err"]),
            ]
            for name, v, e in rows:
                lines.append(f"{name:<28}{v:14.6f} ± {e:.6f}")
            lines.append(f"{'corr(nll model, nll ref)':<28}{100 * s['nll_correlation']:13.2f} %")
            lines.append("")
            lines.append(f"{'KLD mean':<28}{s['kld_mean']:14.8f} ± {s['kld_mean_err']:.8f}")
            lines.append(f"{'KLD median':<28}{s['kld_median']:14.8f} ± {s['kld_median_err']:.8f}")
            lines.append(f"{'KLD 90%':<28}{s['kld_p90']:14.8f}")
            lines.append(f"{'KLD 99%':<28}{s['kld_p99']:14.8f} ± {s['kld_p99_err']:.8f}")
            lines.append(f"{'KLD 99.9%':<28}{s['kld_p99_9']:14.8f}")
            lines.append(f"{'KLD max':<28}{s['kld_max']:14.8f}")
            lines.append(f"{'KLD min':<28}{s['kld_min']:14.8f}")
            lines.append(f"{'same top-1 token':<28}{pct:13.3f} % ± {100 * s['top1_agreement_err']:.3f} %"
                         f"  ({s['top1_agree_count']}/{s['tokens']})")
        return "\n".join(lines)


def _progress_bar(total: int, enabled: bool | None, desc: str):
    return bar(total, desc, "tok", enabled)


def evaluate(model, tokens, reference=None, *, ctx: int = 512, stride: int | None = None,
             batch: int = 128, progress: bool | None = None, session_options=None,
             on_window: Callable[[int, int], object] | None = None) -> EvalResult:
    """Score a token sequence with a sliding window; compare with a reference model.

    Parameters
    ----------
    model : Model, path, InferenceSession
        The (encoded) olv model under test.
    tokens : sequence of int
        int token ids ``[n]``, ``n >= 2``.
    reference : path, Model, InferenceSession, transformers model, optional
        See :func:`logit_source`. Its vocabulary must equal the model's.
    ctx : int
        Window length in tokens (>= 2).
    stride : int, optional
        Window start step, ``1 <= stride <= ctx`` (default ``ctx // 2``).
    batch : int
        Tokens per prefill call (>= 1).
    progress : bool, optional
        A tqdm progress bar on stderr over the scored tokens (None: only on a terminal).

    Returns
    -------
    EvalResult

    Raises
    ------
    InvalidArgument
        Fewer than 2 tokens, ids outside the vocabulary, bad ctx/stride/batch, a reference with
        another vocabulary size.
    """
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size < 2 or (ids.dtype.kind not in "iu"):
        raise InvalidArgument(
            f"tokens must be a 1-D sequence of at least 2 integer ids, got shape "
            f"{list(ids.shape)} dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    for name, v, lo in (("ctx", ctx, 2), ("batch", batch, 1)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise InvalidArgument(f"{name} must be an integer >= {lo}, got {v!r}")
    stride = ctx // 2 if stride is None else stride
    if not isinstance(stride, (int, np.integer)) or not 1 <= stride <= ctx:
        raise InvalidArgument(f"stride must be an integer in [1, ctx={ctx}], got {stride!r}")
    src = logit_source(model, session_options)
    if not isinstance(src, OlvLogits):
        raise InvalidArgument("the model under test must be an olv model (use reference= for "
                              "a transformers checkpoint)")
    ref = logit_source(reference, session_options) if reference is not None else None
    if src.vocab is not None and (ids.min() < 0 or ids.max() >= src.vocab):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise InvalidArgument(f"tokens: ids must be in [0, {src.vocab}), got {bad}")
    if ref is not None and src.vocab is not None and ref.vocab is not None and ref.vocab != src.vocab:
        raise InvalidArgument(
            f"the reference's vocabulary has {ref.vocab} tokens, the model's {src.vocab}")
    plan = list(windows(int(ids.size), int(ctx), int(stride)))
    total = sum(end - first for _, end, first in plan)
    pos, nll, rnll, kld, top1 = [], [], [], [], []
    bar = _progress_bar(total, progress, "eval")
    try:
        for w, (begin, end, first) in enumerate(plan):
            src.start()
            if ref is not None:
                ref.start()
            for a in range(begin, end, batch):
                b = min(a + batch, end)
                chunk = ids[a:b]
                # row r predicts token a + r + 1; keep rows whose target is in [first, end)
                r0 = max(first - 1 - a, 0)
                r1 = min(end - 1 - a, b - a)
                z = src.run(chunk)
                zr = ref.run(chunk) if ref is not None else None
                for s0 in range(r0, r1, 32):  # float64 work 32 rows at a time
                    s1 = min(s0 + 32, r1)
                    tgt = ids[a + s0 + 1:a + s1 + 1]
                    lq = _log_softmax(z[s0:s1])
                    nll.append(-lq[np.arange(s1 - s0), tgt])
                    pos.append(np.arange(a + s0 + 1, a + s1 + 1))
                    if zr is not None:
                        lb = _log_softmax(zr[s0:s1])
                        rnll.append(-lb[np.arange(s1 - s0), tgt])
                        kld.append((np.exp(lb) * (lb - lq)).sum(axis=-1))
                        top1.append(np.argmax(z[s0:s1], -1) == np.argmax(zr[s0:s1], -1))
                    bar.update(s1 - s0)
            if on_window is not None:
                on_window(w, len(plan))
    finally:
        bar.close()
        src.close()
        if ref is not None:
            ref.close()
    cat = (lambda xs: np.concatenate(xs) if xs else None)
    return EvalResult(cat(pos).astype(np.int64), cat(nll), cat(rnll) if ref else None,
                      cat(kld) if ref else None, cat(top1) if ref else None, int(ctx),
                      int(stride), int(batch), src.name, ref.name if ref else None)


def perplexity(model, tokens, **kwargs) -> float:
    """Perplexity ``exp(mean nll)`` of ``tokens`` under ``model`` (see :func:`evaluate`)."""
    return evaluate(model, tokens, **kwargs).perplexity


def read_tokens(path, tokenizer=None, token_ids: bool | None = None) -> np.ndarray:
    """A token sequence from a file.

    ``.npy``: an integer array (flattened). With ``token_ids=True`` (or a ``.ids`` / ``.txt``
    file whose content is only integers): integers separated by whitespace or commas.
    Otherwise UTF-8 text, encoded with ``tokenizer`` (no special tokens added).

    Raises
    ------
    InvalidArgument
        A missing file, a non-integer item in a token-id file, text without a tokenizer.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise InvalidArgument(f"{p}: no such file")
    if p.suffix == ".npy":
        try:  # the header is checked against the file before numpy allocates anything
            with open(p, "rb") as fh:
                dtype, shape, nbytes = read_npy_header(fh, "header", ValueError)
                left = p.stat().st_size - fh.tell()
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{p}: not a readable .npy array ({exc})") from None
        except InvalidArgument as exc:
            why = str(exc).removeprefix(f"{p}: ")
            raise InvalidArgument(f"{p}: not a readable .npy array ({why})") from None
        if dtype.kind not in "iu":
            raise InvalidArgument(f"{p}: token ids must be integers, got dtype {dtype}")
        if nbytes != left:
            raise InvalidArgument(f"{p}: its .npy header declares {shape} {dtype} ({nbytes} "
                                  f"bytes of data), the file holds {left} bytes of data")
        try:
            a = np.load(p, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InvalidArgument(f"{p}: not a readable .npy array ({exc})") from None
        return a.reshape(-1).astype(np.int64)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason}); "
                              "pass a UTF-8 text file or token ids") from None
    items = text.replace(",", " ").split()
    looks_ids = bool(items) and all(t.lstrip("-").isdigit() for t in items)
    if token_ids or (token_ids is None and looks_ids and p.suffix in (".ids", ".txt")):
        bad = next((t for t in items if not t.lstrip("-").isdigit()), None)
        if bad is not None:
            raise InvalidArgument(f"{p}: token-id files hold integers; got item {bad!r}")
        return np.asarray([int(t) for t in items], np.int64)
    if tokenizer is None:
        raise InvalidArgument(f"{p}: a text file needs tokenizer.json beside the model "
                              "(or pass token ids)")
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
