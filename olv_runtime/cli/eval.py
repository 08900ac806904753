"""``olv eval``: perplexity with a sliding window, and KL divergence / top-1 agreement / Δ
perplexity against a reference model (``olv eval --help``; :mod:`olv_runtime.generation.evaluate`)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time

import numpy as np

from olv_runtime.cli.common import CliError, _positive, _session_options, _tokenizer_for
from olv_runtime.generation.evaluate import evaluate, read_tokens
from olv_runtime.io import check_output_not_input, load, model_files


def cmd_eval(args) -> int:
    if args.plot and args.reference is None:  # checked before the (long) evaluation
        raise CliError("--plot needs --reference (it plots the per-position KL divergence)")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib (pip install matplotlib); nothing was run")
    path = pathlib.Path(args.model)
    outputs = [(o, v) for o, v in (("--json", args.json), ("--per-token", args.per_token),
                                   ("--plot", args.plot)) if v]
    if outputs:  # never one of the files the evaluation reads, nor each other
        inputs = model_files(load(path))
        src_opt = "--file" if args.file is not None else "--token-ids"
        inputs.append((f"the {src_opt} input", pathlib.Path(args.file or args.token_ids)))
        if args.reference is not None:
            ref = pathlib.Path(args.reference)
            inputs += model_files(load(ref)) if ref.is_file() else \
                [("a file of the --reference checkpoint", f) for f in
                 (ref.iterdir() if ref.is_dir() else ())]
        for i, (opt, value) in enumerate(outputs):
            check_output_not_input(value, inputs + [(f"the {o} output", pathlib.Path(v))
                                                    for o, v in outputs[:i]], opt)
    tokenizer = _tokenizer_for(path) if args.file is not None else None
    src = args.file if args.file is not None else args.token_ids
    tokens = read_tokens(src, tokenizer, token_ids=args.token_ids is not None)
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    if tokens.size < 2:
        raise CliError(f"{src}: {tokens.size} tokens; eval needs at least 2")
    opts = _session_options(args)
    progress = {"auto": None, "yes": True, "no": False}[args.progress]
    t0 = time.perf_counter()
    res = evaluate(path, tokens, args.reference, ctx=args.ctx, stride=args.stride,
                   batch=args.batch, progress=progress, session_options=opts)
    elapsed = time.perf_counter() - t0
    print(res.table())
    print(f"time {elapsed:.1f} s ({res.tokens / elapsed:.1f} scored tokens/s)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {**res.summary(), "seconds": elapsed, "ctx": res.ctx, "stride": res.stride,
             "model": res.model_name, "reference": res.reference_name}, indent=2))
    if args.per_token:
        arrays = {"positions": res.positions, "nll": res.nll}
        if res.kld is not None:
            arrays.update(ref_nll=res.ref_nll, kld=res.kld, top1=res.top1)
        np.savez(args.per_token, **arrays)
    if args.plot:
        if res.kld is None:
            raise CliError("--plot needs --reference (it plots the per-position KL divergence)")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise CliError("--plot needs matplotlib (pip install matplotlib)") from None
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(res.positions, res.kld, lw=0.5)
        ax.set_xlabel("token position")
        ax.set_ylabel("KL(ref || model), nats")
        ax.set_yscale("log")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def add_eval_parser(sub, add_run_opts) -> None:
    e = sub.add_parser(
        "eval", help="perplexity (sliding window); with --reference: KL divergence, top-1 "
                     "agreement and Δ perplexity as llama-perplexity --kl-divergence")
    e.add_argument("model", help="converted .onnx model under test")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", "-f", help="UTF-8 text file (tokenized with tokenizer.json beside "
                                          "the model)")
    src.add_argument("--token-ids", help="token-id file: .npy integer array, or integers "
                                         "separated by whitespace/commas")
    e.add_argument("--reference", default=None, metavar="MODEL",
                   help="reference: another olv .onnx model, or a Hugging Face checkpoint "
                        "directory (run through transformers, float32)")
    e.add_argument("--ctx", type=_positive, default=512, help="window length (default: 512)")
    e.add_argument("--stride", type=_positive, default=None,
                   help="window step; each window scores its last STRIDE tokens "
                        "(default: ctx/2)")
    e.add_argument("--batch", type=_positive, default=128,
                   help="tokens per prefill call (default: 128)")
    e.add_argument("--max-tokens", type=_positive, default=None,
                   help="use only the first N tokens of the file")
    e.add_argument("--progress", choices=["auto", "yes", "no"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    e.add_argument("--json", default=None, metavar="FILE", help="write the statistics as JSON")
    e.add_argument("--per-token", default=None, metavar="FILE.npz",
                   help="write per-token positions, nll, ref_nll, kld, top1")
    e.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot the per-position KL divergence (needs matplotlib)")
    add_run_opts(e)
    e.set_defaults(func=cmd_eval)
