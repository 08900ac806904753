"""``olv chat``: an interactive multi-turn conversation (``olv chat --help``), and the sampling
and stopping options shared with ``olv generate``.

Reads one user message per line from stdin (a ``> `` prompt when stdin is a terminal), streams
the answer to stdout, keeps the KV cache across turns. ``/reset`` starts over (the ``--system``
message stays), ``/exit``, ``/quit`` or end of input (Ctrl-D) leave. Ctrl-C stops the current
answer (kept, partial, in the conversation) and returns to the prompt; at the prompt it clears
the line. ``--transcript FILE`` appends one JSON object per turn (rendered prompt, answer,
prefill and cached token counts).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import olv_runtime
from olv_runtime.cli.common import (
    CliError,
    _non_negative,
    _session_options,
    _tokenizer_for,
)
from olv_runtime.errors import ContextLengthError
from olv_runtime.generation.chat import (
    ChatTemplateError,
    Conversation,
    load_chat_template,
    read_template_file,
)
from olv_runtime.generation.sampling import SamplingParams
from olv_runtime.io import check_output_not_input, model_files
from olv_runtime.io.sidecars import sidecar_path


def add_sampling_options(q: argparse.ArgumentParser, basic: bool) -> None:
    """Options of :class:`olv_runtime.SamplingParams` and stopping (``basic``: also
    --temperature/--top-k/--top-p/--seed; ``olv generate`` and ``olv chat`` both take them)."""
    if basic:
        q.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0 = greedy (default)")
        q.add_argument("--top-k", type=_non_negative, default=0,
                       help="sample among the k most likely tokens (default: 0 = all)")
        q.add_argument("--top-p", type=float, default=1.0,
                       help="nucleus sampling mass in (0, 1] (default: 1.0 = all)")
        q.add_argument("--seed", type=_non_negative, default=None,
                       help="random seed for sampling (an integer >= 0)")
    q.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below MIN_P x the top probability (default: 0 = off)")
    q.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty",
                   type=float, default=1.0,
                   help="repetition penalty as transformers/llama.cpp (default: 1.0 = off)")
    q.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once per token already present (default: 0)")
    q.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence of a token (default: 0)")
    q.add_argument("--repeat-last-n", dest="penalty_last_n", type=_non_negative, default=0,
                   help="penalties look at the last N tokens (default: 0 = all)")
    q.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the text contains TEXT (not printed); repeatable")
    q.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the eos ids (generation_config.json eos_token_id)")
    add_context_option(q)


def context_limit_arg(text: str):
    """``--context-limit``: "model", "none" or an integer >= 1."""
    if text in ("model", "none"):
        return None if text == "none" else "model"
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected 'model', 'none' or an integer >= 1, got "
                                         f"{text!r}")
    return int(text)


def add_context_option(q: argparse.ArgumentParser) -> None:
    q.add_argument("--context-limit", type=context_limit_arg, default="model", metavar="N",
                   help="positions a sequence may use: a longer prompt is refused before the "
                        "prefill, generation stops there (finish reason length); 'model' "
                        "(default): the model's max_position_embeddings; N: more, for a model "
                        "whose RoPE scaling allows it; 'none': no limit")


def sampling_kwargs(args) -> dict:
    """:func:`olv_runtime.generate` keyword arguments from the parsed options."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                penalty_last_n=args.penalty_last_n, seed=args.seed,
                stop=list(args.stop) or None,
                eos_token_id=None if args.ignore_eos else "auto",
                context_limit=getattr(args, "context_limit", "model"))


def cmd_chat(args) -> int:
    path = pathlib.Path(args.model)
    tokenizer = _tokenizer_for(path)
    if tokenizer is None:
        raise CliError(f"chat needs tokenizer.json beside the model ({path.parent})")
    template, special = load_chat_template(path)
    if args.chat_template:
        if not pathlib.Path(args.chat_template).is_file():
            raise CliError(f"--chat-template {args.chat_template}: no such file")
        template = read_template_file(args.chat_template)
    if template is None:
        late = [n for n in ("chat_template.jinja", "tokenizer_config.json")
                if (path.parent / n).is_file() and path.is_file()
                and sidecar_path(path, n) is None]
        if late and path.is_file():
            raise CliError(
                f"no chat template: {' / '.join(late)} in {path.parent} is not a file recorded "
                "for this model at conversion (olv convert records the SHA-256 of each sidecar "
                "it copies; a file added or changed later is not read, README 'Sidecars'): "
                "pass --chat-template FILE, or put the template in the checkpoint folder and "
                "convert again")
        raise CliError(f"no chat template: {path.parent} has neither chat_template.jinja nor a "
                       "chat_template in tokenizer_config.json (pass --chat-template FILE)")
    kw = sampling_kwargs(args)
    SamplingParams(kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"],
                   kw["repetition_penalty"], kw["presence_penalty"], kw["frequency_penalty"],
                   kw["penalty_last_n"])  # validate before loading the model
    model = olv_runtime.load(path)
    if args.transcript:  # appended to: never one of the files the model or chat reads
        inputs = model_files(model)
        if args.chat_template:
            inputs.append(("the --chat-template file", pathlib.Path(args.chat_template)))
        check_output_not_input(args.transcript, inputs, "--transcript")
    sess = olv_runtime.InferenceSession(model, _session_options(args))
    conv = Conversation(sess, tokenizer, template, special, system=args.system,
                        generate_kwargs=kw)
    interactive = sys.stdin.isatty()
    transcript = open(args.transcript, "a", encoding="utf-8") if args.transcript else None
    if interactive:
        print(f"olv chat {path.name}: type a message; /reset starts over, /exit or Ctrl-D "
              "leaves, Ctrl-C stops an answer", file=sys.stderr, flush=True)
    turn = 0
    try:
        while True:
            try:
                if interactive:
                    line = input("> ")
                else:
                    line = sys.stdin.readline()
                    if not line:
                        break
                    line = line.rstrip("\n")
            except EOFError:
                if interactive:
                    print(file=sys.stderr)
                break
            except KeyboardInterrupt:
                print(file=sys.stderr, flush=True)  # Ctrl-C at the prompt clears the line
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                conv.reset()
                print("[conversation reset]", file=sys.stderr, flush=True)
                continue
            try:
                rep = conv.send(line, args.max_new_tokens,
                                text_callback=lambda s: print(s, end="", flush=True))
            except KeyboardInterrupt:
                print("\n[interrupted]", file=sys.stderr, flush=True)
                continue
            except (ChatTemplateError, ContextLengthError) as exc:
                print(f"olv chat: error: {exc}", file=sys.stderr, flush=True)
                continue
            print(flush=True)
            turn += 1
            if rep.finish_reason == "interrupted":
                print("[answer interrupted]", file=sys.stderr, flush=True)
            st = rep.stats
            print(f"[turn {turn}: prefill {rep.prefill_tokens} tokens ({rep.cached_tokens} "
                  f"cached), {st.new_tokens} generated, {st.decode_tokens_per_second:.1f} tok/s, "
                  f"{rep.finish_reason}]", file=sys.stderr, flush=True)
            if transcript is not None:
                transcript.write(json.dumps({
                    "turn": turn, "user": line, "rendered": rep.rendered, "answer": rep.answer,
                    "ids": rep.ids.tolist(), "finish_reason": rep.finish_reason,
                    "prefill_tokens": rep.prefill_tokens, "cached_tokens": rep.cached_tokens,
                    "reused_prefix": rep.reused_prefix,
                    "messages": conv.messages}) + "\n")
                transcript.flush()
    finally:
        conv.close()
        if transcript is not None:
            transcript.close()
    return 0


def add_chat_parser(sub, add_run_opts) -> None:
    c = sub.add_parser("chat", help="interactive multi-turn chat with the model's chat template",
                       description=__doc__.split("\n\n")[1])
    c.add_argument("model", help="converted .onnx model (tokenizer.json and tokenizer_config.json "
                                 "with a chat_template beside it)")
    c.add_argument("--system", default=None, help="system message put first")
    c.add_argument("--max-new-tokens", type=_non_negative, default=256,
                   help="longest answer in tokens (default: 256)")
    c.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (default: the model's)")
    c.add_argument("--transcript", default=None, metavar="FILE",
                   help="append one JSON line per turn (rendered prompt, answer, token counts)")
    add_sampling_options(c, basic=True)
    add_run_opts(c)
    c.set_defaults(func=cmd_chat)
