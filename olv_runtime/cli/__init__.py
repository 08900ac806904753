"""The ``olv`` command line: convert, compile, generate, chat, eval, serve, bench, demo, inspect,
export-standard.

Run ``olv --help`` or ``olv COMMAND --help``.
"""
from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

import olv_runtime
from olv_runtime import __version__
from olv_runtime.cli.batch import (
    add_engine_options,
    batch_sizes,
    cmd_bench_batch,
    cmd_generate_batch,
    read_json_schema,
)
from olv_runtime.cli.chat import (
    add_chat_parser,
    add_context_option,
    add_sampling_options,
    sampling_kwargs,
)
from olv_runtime.cli.common import (  # noqa: F401
    CliError,
    _int,
    _non_negative,
    _positive,
    _session_options,
    _tokenizer_for,
)
from olv_runtime.cli.eval import add_eval_parser
from olv_runtime.cli.serve import add_serve_parser
from olv_runtime.decoding import resolve
from olv_runtime.errors import LayoutError, OlvError, OutputError, SidecarError
from olv_runtime.executor.decoder_step import prestart_precompile
from olv_runtime.io import check_output_not_input, load, model_files
from olv_runtime.lazy import lazy_module
from olv_runtime.progress import ConversionProgress, bar
from olv_runtime.proto import TensorProto
from olv_runtime.state.files import check_state_path
from olv_runtime.state.restore import check_saveable, trim_state
from olv_runtime.structs import StructValue
from olv_runtime.structs.catalogue import describe
from olv_runtime.structs.initializers import AffineValue, dtype_name

# the converters and the graph builder (onnx) only for the commands that use them: `olv generate`
# and `olv chat` start without them (warm start)
compile_ = lazy_module("olv_runtime.models.compile")
export = lazy_module("olv_runtime.builder.export")
hf = lazy_module("olv_runtime.models.hf")
random_checkpoint = lazy_module("olv_runtime.models.random_checkpoint")


def _warn(msg: str) -> None:
    sys.stdout.flush()
    print(("\n" if _midline[0] else "") + f"olv: warning: {msg}", file=sys.stderr, flush=True)
    _midline[0] = False


def _check_vocab(ids, model, what: str) -> None:
    """Token ids against the model's vocabulary, before anything is printed (CliError)."""
    vocab = model.metadata().get("olv.vocab_size", "")
    if not vocab.isdigit() or not ids:
        return
    bad = next((t for t in ids if not 0 <= t < int(vocab)), None)
    if bad is not None:
        hint = (": tokenizer.json does not match the model" if what == "--prompt" else "")
        raise CliError(f"{what}: token ids must be in [0, {vocab}) (the model's vocabulary), "
                       f"got {bad}{hint}")


def _zero_tokens_hint(tokenizer, text: str, path) -> str:
    """Why a prompt can encode to zero tokens, with what the tokenizer holds: an empty or
    whitespace-only prompt, or a vocabulary with no token for any of its text (such as the
    placeholder vocabulary of a GGUF written without a real tokenizer)."""
    if not text.strip():
        return "the prompt encodes to zero tokens: it is empty or only whitespace"
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    by_id = sorted(vocab, key=vocab.get)
    sample = ", ".join(repr(t) for t in by_id[:4])
    return (f"the prompt encodes to zero tokens: tokenizer.json beside the model "
            f"({path.parent}) has {len(vocab)} tokens ({sample}, ...) and none of them covers "
            "the prompt's text -- a placeholder vocabulary (e.g. a GGUF written without its "
            "real tokenizer.ggml.tokens) or another model's tokenizer; use --prompt-ids")


def _check_positions(n_prompt: int, max_new: int, model, context_limit="model") -> None:
    """The prompt against the context before any work (CliError with the numbers); a note
    when the new tokens will stop at the context (generate's finish reason ``length``)."""
    text = model.metadata().get("olv.max_position_embeddings", "")
    if context_limit == "model":
        limit, what = (int(text), "the model's max_position_embeddings") if text.isdigit() \
            else (None, "")
    else:
        limit, what = context_limit, "--context-limit"
    if limit is None:
        if text.isdigit() and n_prompt + max_new > int(text):
            _warn(f"prompt ({n_prompt} tokens) + new tokens ({max_new}) exceeds the model's "
                  f"max_position_embeddings ({text}): positions beyond it were not trained and "
                  "the output may degrade")
        return
    if n_prompt + 1 > limit:
        raise CliError(f"the prompt of {n_prompt} tokens does not fit the context of {limit} "
                       f"positions ({what}) with room for a new token: at most {limit - 1} "
                       "prompt tokens (--context-limit N allows more for a model whose RoPE "
                       "scaling does, 'none' turns the check off)")
    if n_prompt + max_new > limit:
        _warn(f"prompt ({n_prompt} tokens) + new tokens ({max_new}) exceeds "
              + (f"the model's max_position_embeddings ({limit})" if context_limit == "model"
                 else f"--context-limit ({limit})")
              + f": generation stops at {limit - n_prompt} new tokens (finish reason length)")


def _parse_ids(text: str) -> list[int]:
    """Token ids from ``1,2,3`` (commas; spaces around them allowed)."""
    parts = [t.strip() for t in text.split(",")]
    if not text.strip():
        raise CliError("--prompt-ids is empty")
    ids = []
    for t in parts:
        if not t.lstrip("-").isdigit() or any(c.isspace() for c in t):
            raise CliError(
                f"--prompt-ids must be comma-separated integers such as 1,2,3; got item {t!r} "
                f"in {text!r}"
            )
        ids.append(int(t))
    return ids


def cmd_convert(args) -> int:
    ext = {"auto": None, "yes": True, "no": False}[args.external_data]
    t0 = time.perf_counter()
    with ConversionProgress() as progress, warnings.catch_warnings():  # a bar on a terminal
        warnings.simplefilter("ignore", hf.ConversionWarning)  # listed below instead
        res = hf.convert(args.checkpoint_dir, args.output, weights=args.weights,
                      external_data=ext, progress=progress, kv=args.kv,
                      scale_dtype=args.scale_dtype)
    kind = (f"weights {args.weights}" if not os.path.isfile(args.checkpoint_dir)
            else "GGUF tensors referenced in place, 0 bytes copied")
    print(f"wrote {res.path} ({res.nbytes / 1e6:.1f} MB, {kind}) in "
          f"{time.perf_counter() - t0:.1f} s")
    if res.unused_tensors:
        names = list(res.unused_tensors)
        print(f"note: {len(names)} checkpoint tensors are not used by the "
              f"{res.architecture} graph: {', '.join(names[:20])}"
              + (f" ... (+{len(names) - 20})" if len(names) > 20 else ""), file=sys.stderr)
    return 0


def _warm_up(sess, prompt_ids) -> float:
    """A 2-token prefill on a throwaway state (one token, no decode step), so that the prefill
    kernels are compiled or loaded and have run once before the real prompt (its first-call
    costs stay out of the prefill rate). Returns its seconds.

    The decode step is not warmed up: on a cold numba cache its compiled program is built by a
    worker process (:mod:`olv_runtime.kernels.precompile`) while this prefill and the real one
    run and the first token is printed; the second token waits for it if it is not done. The
    decode rate stays honest without a warm-up: :func:`olv_runtime.generate` excludes the time
    spent compiling or waiting for kernels from it and reports that time
    (``GenerationStats.decode_compile_seconds``), also when no worker is used."""
    t0 = time.perf_counter()
    olv_runtime.generate(sess, list(prompt_ids[:2]), 1)
    return time.perf_counter() - t0


def _run_generate(model_path: pathlib.Path, prompt_ids, args, tokenizer, model=None) -> None:
    model = model if model is not None else olv_runtime.load(model_path)
    t_sess = time.perf_counter()
    sess = olv_runtime.InferenceSession(model, _session_options(args))
    t_sess = time.perf_counter() - t_sess
    t_warm = _warm_up(sess, prompt_ids)
    stats = olv_runtime.GenerationStats()
    first = []  # perf_counter() at the first and the second generated token

    def show(tok: int) -> None:  # without a tokenizer: the ids
        _midline[0] = True
        if len(first) < 2:
            first.append(time.perf_counter())
        print(tok, end=" ", flush=True)

    kw = sampling_kwargs(args)
    if kw["stop"] and tokenizer is None:
        raise CliError(f"--stop needs tokenizer.json beside the model ({model_path.parent})")
    if getattr(args, "json_schema", None) is not None:
        kw["json_schema"] = read_json_schema(args.json_schema)
    if tokenizer is not None:  # stream through TextStream (stop strings, UTF-8 hold-back)
        kw.update(tokenizer=tokenizer, text_callback=lambda piece: print(piece, end="", flush=True),
                  skip_special_tokens=not getattr(args, "special", False))

        def cb(tok: int) -> None:
            _midline[0] = True
            if len(first) < 2:
                first.append(time.perf_counter())
    else:
        cb = show
    state, feed = None, prompt_ids
    cache = getattr(args, "prompt_cache", None)
    if cache:  # reuse the KV of the longest cached prefix of the prompt
        if pathlib.Path(cache).is_file():
            state = olv_runtime.load_state(sess, cache)
            feed = list(prompt_ids)[trim_state(state, prompt_ids):]
        else:
            state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    res = olv_runtime.generate(
        sess, feed, args.max_new_tokens, callback=cb, stats=stats, return_result=True,
        logprobs=bool(args.logprobs), top_logprobs=args.logprobs, state=state, **kw,
    )  # Ctrl-C: generate stops cleanly, finish_reason "interrupted", stats so far
    if state is not None:
        state.save(cache)
        state.close()
    print()
    _midline[0] = False
    if res.logprobs:
        def tok_text(t):
            return repr(tokenizer.id_to_token(t)) if tokenizer is not None else str(t)

        print("token logprobs (natural log, raw logits) and top alternatives:", file=sys.stderr)
        for lp in res.logprobs:
            alts = ", ".join(f"{tok_text(t)} {v:.4f}" for t, v in lp.top)
            print(f"  {lp.token_id:>7} {tok_text(lp.token_id):>16} {lp.logprob:9.4f}   {alts}",
                  file=sys.stderr)
    if res.finish_reason != "length":
        print(f"stopped: {res.finish_reason}"
              + (f" ({res.stop_string!r})" if res.stop_string else "")
              + (" (Ctrl-C)" if res.finish_reason == "interrupted" else ""), file=sys.stderr)
    timings = getattr(args, "timings", False)
    steps = max(stats.new_tokens - 1, 0)  # decode steps timed (the first token: the prefill)
    if steps < MIN_RATE_STEPS or stats.decode_seconds < MIN_RATE_SECONDS:
        # a few milliseconds (a tiny model, a short run, the steps left after a cold start's
        # wait for kernels) give a number, not a rate
        decode = (f"decode rate n/a ({steps} steps in {stats.decode_seconds * 1e3:.1f} ms: too "
                  "short to measure; olv bench measures it)")
    else:
        decode = f"decode {stats.decode_tokens_per_second:.1f} tok/s"
    print(
        (f"prefill {stats.prefill_tokens} tokens ({stats.cached_tokens} from the prompt "
         f"cache); " if cache else "") +
        f"prompt {stats.prompt_tokens} tokens: prefill {stats.prefill_tokens_per_second:.1f} tok/s; "
        f"generated {stats.new_tokens} tokens: {decode}"
        + (f" (after a {t_warm:.2f} s warm-up prefill that compiled or loaded the prefill "
           "kernels)" if timings else ""),
        file=sys.stderr,
    )
    if timings:  # kernel diagnostics: --timings (olv demo always), not on every warm run
        _print_compile_wait(stats)
    if res.finish_reason == "interrupted":
        raise _Interrupted()
    if first and getattr(args, "timings", False):
        c = sess.counters.snapshot()
        hits = (f", compiled entries {c['compiled_hits']} hits / {c['compiled_misses']} misses"
                if model.proto.compiled_tensors else "")
        second = (f", second token {first[1] - olv_runtime.IMPORT_TIME:.2f} s"
                  if len(first) > 1 else "")
        print(f"first token {first[0] - olv_runtime.IMPORT_TIME:.2f} s after import olv_runtime"
              f"{second} (session creation {t_sess:.3f} s{hits})", file=sys.stderr)


#: A decode rate is printed when at least this many steps over at least this many seconds
#: were timed (compile and kernel-wait time excluded).
MIN_RATE_STEPS = 3
MIN_RATE_SECONDS = 0.05


def _print_compile_wait(stats) -> None:
    """The seconds the measured generate spent compiling kernels or waiting for them (excluded
    from the rates printed before it), when there were any worth a line (>= 5 ms)."""
    parts = []
    if stats.decode_compile_seconds >= 0.005:
        parts.append(f"the decode calls waited {stats.decode_compile_seconds:.2f} s for compiled "
                     "kernels (compiling, loading them from the numba cache or waiting for the "
                     "compile worker), not counted in the decode rate")
    if stats.prefill_compile_seconds >= 0.005:
        parts.append(f"the prefill spent {stats.prefill_compile_seconds:.2f} s compiling or "
                     "loading kernels, not counted in the prefill rate")
    if parts:
        print("; ".join(parts), file=sys.stderr)


def cmd_generate(args) -> int:
    if args.json_schema is not None:  # checked before any loading
        read_json_schema(args.json_schema)
        if args.batch is not None:
            raise CliError("--json-schema is not supported with --batch (use olv serve's "
                           "response_format)")
        if args.output == "ids":
            raise CliError("--json-schema needs the tokenizer: it cannot be used with --output ids")
    if args.batch is not None:  # many prompts through the batching engine
        return cmd_generate_batch(args)
    path = pathlib.Path(args.model)
    ids = _parse_ids(args.prompt_ids) if args.prompt is None else None  # before any loading
    cache = getattr(args, "prompt_cache", None)
    if cache:  # a target that cannot be written: refused before any work
        check_state_path(cache)
    model = olv_runtime.load(path)
    if cache:  # read and rewritten: never one of the model's files
        check_output_not_input(cache, model_files(model), "--prompt-cache")
    if cache:  # a paged KV cache cannot be saved: refused before generating
        check_saveable(model)
    tokenizer = None
    if args.prompt is not None or args.output == "text":
        tokenizer = _tokenizer_for(model)  # SidecarError: another model's / unreadable
        if tokenizer is None:
            need = "--prompt" if args.prompt is not None else "--output text"
            raise CliError(f"{need} needs tokenizer.json beside the model ({path.parent})"
                           + ("; use --prompt-ids instead" if args.prompt is not None else ""))
    elif args.output == "auto":
        try:
            tokenizer = _tokenizer_for(model)
        except SidecarError as exc:  # --prompt-ids does not need it: print ids instead
            _warn(f"{exc}; printing token ids")
    if args.output == "ids" and args.stop:
        raise CliError("--stop matches text: it cannot be used with --output ids")
    if args.prompt is not None:
        try:
            ids = tokenizer.encode(args.prompt).ids
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise CliError(f"--prompt cannot be encoded with tokenizer.json beside the model "
                           f"({path.parent}): {str(exc)[:200]}; use --prompt-ids") from None
        if not ids:
            raise CliError(_zero_tokens_hint(tokenizer, args.prompt, path))
    _check_vocab(ids, model, "--prompt" if args.prompt is not None else "--prompt-ids")
    _check_positions(len(ids), args.max_new_tokens, model, args.context_limit)
    if args.output == "ids":  # the tokenizer only encoded --prompt: print ids, no echo
        tokenizer = None
    if tokenizer is not None and args.prompt is not None:
        print(args.prompt, end="", flush=True)
        _midline[0] = True
    _run_generate(path, ids, args, tokenizer, model)
    return 0


def cmd_bench(args) -> int:
    if args.batch is not None:  # aggregate decode rates of the batching engine
        return cmd_bench_batch(args)
    model = olv_runtime.load(args.model)
    _check_positions(args.prompt_len, args.new_tokens, model, args.context_limit)
    sess = olv_runtime.InferenceSession(model, _session_options(args))
    vocab = int(model.metadata().get("olv.vocab_size", "100"))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, size=args.prompt_len).tolist()
    print(f"bench {args.model}: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"{args.runs} runs (+1 warm-up), threads={args.threads or 'default'}, "
          f"activations {'int8' if args.quantize_activations else 'float32 (exact)'}",
          file=sys.stderr)
    prefill, decode = [], []
    with bar(args.runs + 1, "bench", "run") as progress:  # a bar on a terminal only
        for r in range(args.runs + 1):
            st = olv_runtime.GenerationStats()
            olv_runtime.generate(sess, prompt, args.new_tokens, stats=st,
                                 context_limit=args.context_limit)
            progress.update(1)
            if r == 0:
                continue
            prefill.append(st.prefill_tokens_per_second)
            decode.append(st.decode_tokens_per_second)
            progress.write(f"  run {r}: prefill {prefill[-1]:.1f} tok/s, decode "
                           f"{decode[-1]:.1f} tok/s", file=sys.stderr)
    c = sess.counters.snapshot()
    print(f"prefill {statistics.median(prefill):.1f} tok/s, decode {statistics.median(decode):.1f} "
          f"tok/s (median of {args.runs}); bytes dequantized {c['bytes_dequantized']}")
    return 0


def cmd_make_checkpoint(args) -> int:
    out = pathlib.Path(args.directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CliError(f"{str(out)!r} exists and is not an empty directory: make-checkpoint "
                       "writes a new checkpoint folder (choose another path)")
    random_checkpoint.write_chat_checkpoint(out, seed=args.seed, num_hidden_layers=args.layers)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote a random Qwen2 checkpoint ({args.layers} layers, random weights: the text it "
          f"generates is noise) with a tokenizer and a ChatML chat template to {out}: {files}")
    print(f"next: olv convert {out} model.onnx && olv chat model.onnx")
    return 0


def cmd_demo(args) -> int:
    _session_options(args)  # validate --threads before building anything
    prestart_precompile()  # empty numba cache: the compile worker starts up during the build
    work = pathlib.Path(args.workdir) if args.workdir else pathlib.Path(tempfile.mkdtemp(prefix="olv-demo-"))
    ckpt = work / "checkpoint"
    print(f"[1/3] building a small random Qwen2 checkpoint in {ckpt} (no download)", flush=True)
    random_checkpoint.write_random_qwen2(ckpt, seed=args.seed)
    out = work / "model.onnx"
    print(f"[2/3] converting to {out} (weights int4-block32)", flush=True)
    hf.convert(ckpt, out, weights="int4-block32")
    print(f"[3/3] generating {args.max_new_tokens} tokens (random weights: the text is noise; "
          "the first run also compiles the numba kernels, cached afterwards)", flush=True)
    tokenizer = _tokenizer_for(out)
    prompt = "hello decode loop"
    ids = tokenizer.encode(prompt).ids
    print(prompt, end="", flush=True)
    _midline[0] = True
    gen_args = argparse.Namespace(
        max_new_tokens=args.max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None,
        threads=args.threads, stop_at_eos=False, quantize_activations=args.quantize_activations,
        min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
        penalty_last_n=0, stop=[], ignore_eos=True, logprobs=0, timings=True,
    )
    _run_generate(out, ids, gen_args, tokenizer)
    if not args.workdir:
        print(f"(checkpoint and model left in {work}; remove it when done)", file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    model = olv_runtime.load(args.model)
    p = model.proto
    g = p.graph
    print(f"model {args.model}: ir_version {p.ir_version}, opsets "
          + ", ".join(f"{o.domain or 'ai.onnx'}:{o.version}" for o in p.opset_import))
    for k, v in model.metadata().items():
        print(f"  meta {k} = {v}")
    print(f"nodes {len(g.node)}, dense initializers {len(g.initializer)}, encoded initializers "
          f"{len(g.encoded_initializer)}, struct types {len(p.struct_types)}")
    resolved = resolve(model)  # validates; OlvError -> "olv inspect: error: ..."
    cat = resolved.catalogue

    def show_layout(layout, indent):
        for lf in layout.leaves:
            shape = "".join(f"[{d}]" for d in lf.shape)
            strides = f" strides {list(lf.strides)}" if lf.shape else ""
            print(f"{indent}{lf.path}: {dtype_name(lf.elem_type)}{shape} ({lf.bits} bits each, "
                  f"{'signed' if lf.signed else 'unsigned' if lf.kind != 'float' else lf.kind}) "
                  f"at bit {lf.offset}{strides}")
        for c in layout.constants:
            vals = c.value.reshape(-1)[:8].tolist()
            more = " ..." if c.value.size > 8 else ""
            print(f"{indent}{c.path}: constant {dtype_name(c.elem_type)}{list(c.value.shape)} = "
                  f"{vals}{more}")

    print("struct catalogue:" if cat.ids() else "struct catalogue: (empty)")
    for tid in cat.ids():
        decl = cat.get(tid)
        dec = f", decoder {decl.decoder.name!r}" if decl.HasField("decoder") else ""
        try:
            layout = cat.layout(tid)
            size = f"record {layout.bits // 8} bytes" if layout.bits % 8 == 0 else f"{layout.bits} bits"
        except LayoutError as exc:
            layout, size = None, f"not byte-encodable ({exc})"
        print(f"  type_id {tid} {decl.name!r}: {decl.WhichOneof('kind')}, {size}{dec}")
        if layout is not None:
            show_layout(layout, "      ")
    print("graph:")
    for vi in g.input:
        print(f"  input  {vi.name}")
    for vi in g.output:
        print(f"  output {vi.name}")
    for b in g.persistent_bindings:
        print(f"  binding {b.input_name} <- {b.output_name}")
    total = 0
    print("encoded values:")
    for name, v in resolved.values.items():
        if isinstance(v, AffineValue):
            n = v.codes.size
            desc = (f"affine {dtype_name(v.storage_type)} axis={v.axis} block_size={v.block_size}")
            logical = f"{dtype_name(v.elem_type)}{list(v.shape)}"
            recs = ""
        else:
            assert isinstance(v, StructValue)
            n = v.nbytes
            desc = f"struct {describe(v.root.declaration)}"
            logical = (f"{dtype_name(v.logical[0])}{list(v.logical[1])}" if v.logical else "none")
            dec = v.decoder.kind if v.decoder is not None else "NO DECODER"
            recs = f", {v.records} records of {v.record_bytes} bytes, decoder {dec}"
        total += n
        if args.verbose or len(resolved.values) <= 64:
            print(f"  {name}: {desc}, payload {n} bytes{recs}, logical {logical}")
            if args.verbose and isinstance(v, StructValue) and v.type_id is None:
                show_layout(v.layout, "      ")
            if args.verbose and isinstance(v, AffineValue):
                zp = (f"zero_point {np.asarray(v.zero_point).dtype}"
                      f"{list(np.shape(v.zero_point))}" if v.zero_point is not None
                      else "no zero_point")
                print(f"      scale {np.asarray(v.scale).dtype}{list(np.shape(v.scale))}, {zp}")
    print(f"encoded payload bytes: {total}")
    if args.verbose:  # -v: also the dense initializers, where every payload is stored, the ops
        print("dense initializers:")
        for t in g.initializer:
            ext = {x.key: x.value for x in t.external_data}
            where = (f"external {ext.get('location')!r} offset {ext.get('offset', '0')} length "
                     f"{ext.get('length', '?')}" if t.data_location == TensorProto.EXTERNAL
                     else f"inline {len(t.raw_data)} bytes" if t.raw_data
                     else "inline (typed fields)")
            print(f"  {t.name}: {dtype_name(t.data_type)}{list(t.dims)}, {where}")
        for ev in g.encoded_initializer:
            if ev.data_location == TensorProto.EXTERNAL:
                ext = {x.key: x.value for x in ev.external_data}
                print(f"  (encoded) {ev.name}: external {ext.get('location')!r} offset "
                      f"{ext.get('offset', '0')} length {ext.get('length', '?')}")
        ops: dict = {}
        for nd in g.node:
            key = f"{nd.domain + '::' if nd.domain else ''}{nd.op_type}"
            ops[key] = ops.get(key, 0) + 1
        print("operators: " + ", ".join(f"{k} x{c}" for k, c in sorted(ops.items())))
    _print_compiled(model, args)
    return 0


def cmd_compile(args) -> int:
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", compile_.CompileWarning)
            rep = compile_.compile_model(args.model, args.output, options=_session_options(args),
                                progress=(lambda msg: print(msg, file=sys.stderr, flush=True))
                                if args.verbose else None)
    except OutputError:  # names the file; nothing is left half-written
        raise
    except OSError as exc:  # unwritable directory, disk full: nothing is left half-written
        raise CliError(f"cannot write {args.output!r}: {exc.strerror or exc}") from None
    for w in caught:
        if issubclass(w.category, compile_.CompileWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for name, why in rep.skipped:
        print(f"  not compiled: {name}: {why}", file=sys.stderr)
    if rep.entries == 0:
        print("warning: no compiled entries were written: no weight of this model has a "
              "prepacked form that can be persisted"
              + (" (see the 'not compiled' lines)" if rep.skipped else
                 " (only the INT4 packed-tile layouts of Linear steps are persisted)"),
              file=sys.stderr)
    print(f"wrote {rep.path} with {rep.entries} compiled entries for {rep.device} "
          f"({rep.bytes / 1e6:.1f} MB in {rep.compiled_path.name}) in "
          f"{time.perf_counter() - t0:.1f} s"
          + (f"; kept {rep.carried} entries of other devices" if rep.carried else "")
          + (f"; copied {', '.join(rep.sidecars)}" if rep.sidecars else ""))
    return 0


def _print_compiled(model, args) -> None:
    p = model.proto
    if not p.devices and not p.compiled_tensors:
        print("compiled tensors: (none)")
        return
    print(f"devices {len(p.devices)}:")
    for i, d in enumerate(p.devices):
        idx = f" index {d.index}" if d.HasField("index") else ""
        print(f"  device {i}: type {d.type!r}{idx}, architecture {d.architecture!r}, runtime "
              f"{d.runtime!r} {d.runtime_version!r}")
    sess = olv_runtime.InferenceSession(model, _session_options(args))
    report = sess.compiled_report()
    c = sess.counters.snapshot()
    print(f"compiled tensors {len(report)} (this session: {c['compiled_hits']} hits, "
          f"{c['compiled_misses']} misses):")
    for st in report:
        why = f" ({st.reason})" if st.reason else ""
        print(f"  [{st.index}] {st.source_name}: device {st.device} ({st.device_text}), "
              f"{st.physical_type}: {st.status}{why}")


def cmd_export_standard(args) -> int:
    ext = {"auto": None, "yes": True, "no": False}[args.external_data]
    inputs = model_files(load(args.model))
    for target in (pathlib.Path(args.output), pathlib.Path(args.output + ".data")):
        check_output_not_input(target, inputs, "output" if target.name == pathlib.Path(
            args.output).name else "output's data file")
    out = export.save_standard(args.model, args.output, feedback=args.feedback, external_data=ext)
    note = " (persistent bindings lowered to caller-managed feedback, see metadata 'olv.feedback')" \
        if args.feedback else ""
    print(f"wrote standard ONNX {out}{note}")
    return 0


#: Why an option of one command is not one of the others (appended to the error).
_OPTION_NOTES = {
    "--kv": " (the KV cache layout is fixed when the model is converted: "
            "'olv convert CHECKPOINT OUT.onnx --kv paged'; the other commands use the model's)",
}


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" hint for a mistyped command, choice or option; options are
    spelled out (no prefix abbreviations: ``--kv`` is convert's option, not an ambiguous prefix of
    ``--kv-cache-tokens`` / ``--kv-dtype``, and a new option never breaks an old abbreviation)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]!r}?"
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            known, owners, todo = [], {}, [(self, None)]
            while todo:  # this parser's options and its commands' (parse_args reports here)
                q, cmd = todo.pop()
                for a in q._actions:
                    known += a.option_strings
                    for o in a.option_strings:
                        owners.setdefault(o, []).append(cmd)
                    if isinstance(a, argparse._SubParsersAction):
                        todo += [(sp, name) for name, sp in a.choices.items()]
            hints, notes = [], []
            for arg in m.group(1).split():
                if arg.startswith("-"):
                    opt = arg.split("=")[0]
                    if opt in owners:
                        # an option of another command: a "did you mean" of itself helps nobody
                        cmds = sorted({c for c in owners[opt] if c})
                        notes.append(f"{opt} is an option of 'olv {' / olv '.join(cmds)}', not "
                                     f"of this command" + _OPTION_NOTES.get(opt, ""))
                        continue
                    close = difflib.get_close_matches(opt, known, n=1, cutoff=0.6)
                    if close:
                        hints.append(f"{arg} -> {close[0]}")
            if hints:
                message += f" (did you mean: {', '.join(hints)}?)"
            if notes:
                message += "; " + "; ".join(notes)
        super().error(message)


def _add_convert_parser(sub) -> None:
    """``olv convert``."""
    c = sub.add_parser("convert", help="convert a Hugging Face Qwen2/Qwen3/Llama checkpoint directory "
                                       "or a GGUF file (qwen2/qwen3/llama) to ONNX")
    c.add_argument("checkpoint_dir", help="directory with config.json and *.safetensors, or a .gguf "
                                          "file (its tensors stay in it: external data; --weights "
                                          "and --external-data do not apply)")
    c.add_argument("output", help="output .onnx path")
    c.add_argument("--weights", choices=["int4-block32", "float32"], default="int4-block32",
                   help="linear weight storage (default: int4-block32)")
    c.add_argument("--scale-dtype", choices=["float16", "float32"], default="float16",
                   help="INT4 block-scale type (default float16: 4.5 bits/weight, the bytes of "
                        "GGUF Q4_0; float32: 5 bits/weight)")
    c.add_argument("--external-data", choices=["auto", "yes", "no"], default="auto",
                   help="write payloads to OUTPUT.data (auto: when the model exceeds 256 MiB)")
    c.add_argument("--kv", choices=["contiguous", "paged", "paged-int8", "paged-f16", "paged-int4",
                                    "paged-mixed"],
                   default="contiguous",
                   help="KV cache: past/present tensors, or paged blocks (dense, INT8, float16, "
                        "INT4, mixed by age); see docs/kv_cache.md")
    c.set_defaults(func=cmd_convert)


def _add_tool_parsers(sub, add_run_opts) -> None:
    """``olv make-checkpoint``, ``demo``, ``inspect``, ``compile`` and ``export-standard``."""
    mk = sub.add_parser("make-checkpoint",
                        help="write a small random Qwen2 checkpoint folder with a real tokenizer "
                             "and a chat template (no download, no torch)")
    mk.add_argument("directory", help="new (or empty) folder to write")
    mk.add_argument("--seed", type=_non_negative, default=0, help="weights seed (default: 0)")
    mk.add_argument("--layers", type=_positive, default=4, help="decoder layers (default: 4)")
    mk.set_defaults(func=cmd_make_checkpoint)

    d = sub.add_parser("demo", help="build a small random Qwen2 model locally, convert it, generate")
    d.add_argument("--workdir", help="where to write the checkpoint and model (default: a temp dir)")
    d.add_argument("--max-new-tokens", type=_positive, default=32,
                   help="tokens to generate (default: 32)")
    d.add_argument("--seed", type=_non_negative, default=0,
                   help="seed of the random weights (default: 0)")
    add_run_opts(d)
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", help="list a model's struct types, encoded values, bindings "
                                       "and compiled entries (with their hit/miss status)")
    i.add_argument("model", help=".onnx model")
    i.add_argument("-v", "--verbose", action="store_true",
                   help="also: every encoded value (with its scale / zero point), every dense "
                        "initializer and where each payload is stored, the operator counts")
    add_run_opts(i)
    i.set_defaults(func=cmd_inspect)

    k = sub.add_parser("compile", help="persist the prepacked weights for this CPU (seed 004 "
                                       "compiled entries) so sessions skip repacking")
    k.add_argument("model", help="input .onnx model")
    k.add_argument("output", help="output .onnx path (payloads in OUTPUT.data and "
                                  "OUTPUT.compiled beside it)")
    k.add_argument("-v", "--verbose", action="store_true", help="one line per compiled weight")
    add_run_opts(k)
    k.set_defaults(func=cmd_compile)

    x = sub.add_parser("export-standard",
                       help="write a model as standard ONNX (DequantizeLinear, decoder nodes)")
    x.add_argument("model", help="olv model (.onnx)")
    x.add_argument("output", help="output .onnx path")
    x.add_argument("--feedback", action="store_true",
                   help="lower persistent bindings to caller-managed past/present feedback "
                        "(otherwise a model with bindings is rejected)")
    x.add_argument("--external-data", choices=["auto", "yes", "no"], default="auto",
                   help="write payloads to OUTPUT.data (auto: when the model exceeds 256 MiB)")
    x.set_defaults(func=cmd_export_standard)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="olv",
        description="olv_runtime: quantized LLM decode on the CPU (ONNX + encoded values + persistent state).",
    )
    p.add_argument("--version", action="version", version=f"olv_runtime {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_convert_parser(sub)

    def add_run_opts(q):
        q.add_argument("--threads", type=_positive, default=None,
                       help="numba threads (default: all cores)")
        q.add_argument("--quantize-activations", action="store_true",
                       help="int8 activations per 32-block in the INT4 linears (faster, "
                            "approximate; as llama.cpp / onnxruntime accuracy_level 4)")

    g = sub.add_parser("generate", help="generate tokens from a converted model")
    g.add_argument("model", help="converted .onnx model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json beside the model)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated, e.g. 1,2,3")
    src.add_argument("--batch", metavar="FILE",
                     help="one prompt per line: all of them through the batching engine, one "
                          "JSON object per prompt on stdout (text, ids, finish_reason, ...)")
    g.add_argument("--max-new-tokens", type=_positive, default=32,
                   help="tokens to generate, >= 1 (default: 32)")
    g.add_argument("--output", choices=["auto", "text", "ids"], default="auto",
                   help="print the generated text (needs tokenizer.json) or the token ids; "
                        "auto: text when the model's tokenizer is usable (default)")
    g.add_argument("--special", action="store_true",
                   help="print special tokens (eos, <|im_end|>, ...) in the text; by default "
                        "they are left out of the printed text (the ids keep them)")
    g.add_argument("--stop-at-eos", action="store_true",
                   help="kept for compatibility: stopping at the eos ids is now the default "
                        "(--ignore-eos turns it off)")
    add_sampling_options(g, basic=True)
    g.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="reuse the KV cache saved in FILE for the prompt's longest cached prefix, "
                        "and save the state there afterwards (refused for another model)")
    g.add_argument("--json-schema", metavar="FILE", default=None,
                   help="structured output: the answer is a JSON value matching the JSON Schema "
                        "in FILE ('-' for any JSON object); needs tokenizer.json and llguidance "
                        "(the serve extra)")
    g.add_argument("--logprobs", type=_non_negative, default=0, metavar="N",
                   help="print each token's logprob and the N best alternatives (stderr)")
    g.add_argument("--timings", action="store_true",
                   help="also print the kernel diagnostics: the warm-up prefill, the seconds "
                        "spent compiling or waiting for kernels, the time from import to the "
                        "first and second token (olv demo always prints them)")
    add_engine_options(g, _positive)
    add_run_opts(g)
    g.set_defaults(func=cmd_generate)

    add_chat_parser(sub, add_run_opts)
    add_eval_parser(sub, add_run_opts)
    add_serve_parser(sub, add_run_opts)

    b = sub.add_parser("bench", help="measure prefill and decode tokens per second")
    b.add_argument("model", help="converted .onnx model")
    b.add_argument("--prompt-len", type=_positive, default=32,
                   help="random prompt tokens (default: 32)")
    b.add_argument("--new-tokens", type=_positive, default=64,
                   help="tokens generated per run (default: 64)")
    b.add_argument("--runs", type=_positive, default=3,
                   help="measured runs after one warm-up; the median is printed (default: 3)")
    b.add_argument("--batch", type=batch_sizes, default=None, metavar="B1,B2,...",
                   help="measure the batching engine at these batch sizes: aggregate and "
                        "per-sequence decode tok/s (e.g. 1,2,4,8,16)")
    add_engine_options(b, _positive)
    add_context_option(b)
    add_run_opts(b)
    b.set_defaults(func=cmd_bench)

    _add_tool_parsers(sub, add_run_opts)
    return p


class _Interrupted(Exception):
    """generate stopped by Ctrl-C after printing what it generated: exit status 130."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OlvError, CliError) as exc:
        sys.stdout.flush()
        print(f"\nolv {args.command}: error: {exc}" if _midline[0] else
              f"olv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except _Interrupted:
        return 130
    except KeyboardInterrupt:  # outside a generation loop: no traceback
        sys.stdout.flush()
        print(("\n" if _midline[0] else "") + f"olv {args.command}: interrupted",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `olv inspect model.onnx | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except OSError as exc:  # a file the command reads or writes: one line naming it
        sys.stdout.flush()
        name = f": {exc.filename!r}" if exc.filename else ""
        print(f"olv {args.command}: error: {exc.strerror or exc}{name}", file=sys.stderr)
        return 2


_midline = [False]  # generated text printed without its final newline yet

