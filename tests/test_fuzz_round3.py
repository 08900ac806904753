"""Fuzz test, round three (issue 26 item 8): the hostile classes of issue 26, seeded.

Five classes, each generated from a fixed seed and run in a child process capped in address
space and time (tests/hostile.py), except the entry swaps (no memory risk; bitwise checks in
process):

* chat template budget: random compositions of size / time bombs -> ChatTemplateError;
* state-file bombs: random byte flips, truncations, header and ``.npy`` header edits of a good
  state file -> StateFileError, or a load whose tokens, KV and sampler are exactly the good
  file's (anything else is a silent wrong result);
* config extremes: genai_config.json decoder fields and GGUF metadata integers set to extreme
  values -> ModelFormatError / ConversionError, or a model that loads / converts;
* prompt length: prompts from just under to far beyond the context -> ContextLengthError, or
  exactly the tokens that fit (finish reason length);
* compiled-entry swaps between same-shaped weights -> misses, logits bitwise equal to the
  uncompiled model.

The bar: 0 raw exceptions, 0 hangs (every case within its bound), 0 memory exhaustion, 0 aborts,
0 silent wrong results.
"""
from __future__ import annotations

import io
import json
import pathlib
import shutil
import struct
import zipfile

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.models.random_checkpoint import write_random_qwen2

from gguf_models import write_gguf
from hostile import run_cases
from test_foreign_configs import _genai_folder, _patched

SEED = 26
CTX = 256


def _check(got: dict, expect: dict, bound: float):
    """Every case has a record whose outcome is one of its allowed ones, within ``bound`` s."""
    exit_ = got.get("__exit__")
    bad = []
    for name, allowed in expect.items():
        rec = got.get(name)
        if rec is None:
            bad.append((name, "no record (hang, abort or memory exhaustion)", exit_))
        elif rec["outcome"] not in allowed:
            bad.append((name, rec))
        elif rec["seconds"] > bound:
            bad.append((name, "too slow", rec))
    assert not bad, bad[:5]


# ------------------------------------------------------------------------------------------------
# chat templates
# ------------------------------------------------------------------------------------------------
FRAGMENTS = [
    "{{{{ 'x' * {n} }}}}", "{{{{ 'x'|center({n}) }}}}", "{{{{ 'x'.rjust({n}) }}}}",
    "{{{{ 'x'.zfill({n}) }}}}", "{{{{ '%0{n}d' % 1 }}}}", "{{{{ '{{:>{n}}}'.format(1) }}}}",
    "{{{{ range({n})|list|length }}}}", "{{{{ lipsum(n={n}) }}}}", "{{{{ 7 ** {n} }}}}",
    "{{{{ messages|tojson(indent={n}) }}}}", "{{{{ 'ab\\ncd'|indent({n}) }}}}",
    "{{{{ [1]|batch({n}, 0)|list|length }}}}", "{{{{ [1]|slice({n})|list|length }}}}",
    "{{{{ ('ab' * 1000)|replace('a', 'x' * {n}) }}}}", "{{{{ (['y' * 4000] * {n})|join }}}}",
    "{{{{ ('\\t' * 3).expandtabs({n}) }}}}", "{{{{ (3 ** 40000) * (3 ** ({n} // 1000)) }}}}",
]
LOOPS = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set r = range(99999) %}{% for i in r %}{% for j in r %}{{ '' }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(80) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
]


def _templates(rng) -> list:
    cases = []
    for i in range(34):
        frag = FRAGMENTS[i % len(FRAGMENTS)]
        n = int(10 ** rng.uniform(7.2, 12))
        pre = "{% for m in messages %}{{ m.content }}{% endfor %}" if rng.random() < 0.5 else ""
        cases.append((f"t{i}", pre + frag.format(n=n)))
    cases += [(f"loop{i}", t) for i, t in enumerate(LOOPS)]
    return cases


def test_fuzz_chat_template_budget():
    cases = _templates(np.random.default_rng(SEED))
    got = run_cases("from olv_runtime.generation.chat import apply_chat_template, ChatTemplateText\n"
                    "M = [{'role': 'user', 'content': 'hi'}]",
                    [(n, f"apply_chat_template(M, ChatTemplateText({t!r}, 'fuzz/{n}'))")
                     for n, t in cases], timeout=400, mem_bytes=1 << 30)
    _check(got, {n: {"ChatTemplateError"} for n, _ in cases}, bound=15)
    assert all(f"fuzz/{n}" in got[n]["msg"] for n, _ in cases)


# ------------------------------------------------------------------------------------------------
# state files
# ------------------------------------------------------------------------------------------------
_LOADED = '''
import hashlib
import numpy as np
import olv_runtime
sess = olv_runtime.InferenceSession(olv_runtime.load(MODEL))

def loaded(p):
    st = olv_runtime.load_state(sess, p)
    h = hashlib.sha256(repr((st.tokens, st.cached_tokens)).encode())
    h.update(repr(st.rng.bit_generator.state if st.rng is not None else None).encode())
    for k, v in st.values.items():
        h.update(k.encode())
        h.update(np.ascontiguousarray(v).tobytes())
    st.close()
    return h.hexdigest()
'''


def _npy(arr) -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array(b, arr, allow_pickle=False)
    return b.getvalue()


def _state_mutations(good: pathlib.Path, root: pathlib.Path, rng) -> list:
    data = good.read_bytes()
    with zipfile.ZipFile(good) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    header = json.loads(np.load(io.BytesIO(members["__header__.npy"])).tobytes().decode())
    extremes = [0, -1, 2 ** 31, 2 ** 63, 2 ** 300, 1.5, "x", None, [], {}, [[[[1]]]],
                "9" * 5000]
    out = []

    def write(name, blob):
        p = root / f"{name}.npz"
        p.write_bytes(blob)
        out.append((name, p))

    def rezip(name, mm, method=zipfile.ZIP_STORED):
        p = root / f"{name}.npz"
        with zipfile.ZipFile(p, "w", compression=method) as zf:
            for k, v in mm.items():
                zf.writestr(k, v)
        out.append((name, p))

    for i in range(30):  # byte flips (1-8 bits) anywhere
        b = bytearray(data)
        for pos in rng.integers(0, len(b), size=int(rng.integers(1, 9))):
            b[pos] ^= 1 << int(rng.integers(0, 8))
        write(f"flip{i}", bytes(b))
    for i in range(8):
        write(f"cut{i}", data[:int(rng.integers(0, len(data)))])
    for i in range(16):  # header fields set to extremes
        h = dict(header)
        key = ["tokens", "cached_tokens", "values", "rng", "format", "version",
               "model_digest"][i % 7]
        h[key] = extremes[int(rng.integers(0, len(extremes)))]
        mm = dict(members)
        mm["__header__.npy"] = _npy(np.frombuffer(json.dumps(h).encode(), np.uint8))
        rezip(f"hdr{i}", mm)
    names = [k for k in members if k != "__header__.npy"]
    for i in range(12):  # .npy headers declaring other shapes / dtypes
        mm = dict(members)
        name = names[int(rng.integers(0, len(names)))]
        shape = tuple(int(2 ** rng.uniform(0, 42)) for _ in range(int(rng.integers(1, 5))))
        descr = ["<f4", "<f8", "|u1", "<i8", "|O", ">f4"][i % 6]
        text = (f"{{'descr': '{descr}', 'fortran_order': {bool(i % 5 == 0)}, "
                f"'shape': {shape}, }}\n")
        body = text.encode()
        mm[name] = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body + \
            members[name][128:]
        rezip(f"npy{i}", mm)
    rezip("deflated", members, zipfile.ZIP_DEFLATED)
    return out


def test_fuzz_state_files(tiny_chat_models, tmp_path):
    sess = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))
    _, state = olv_runtime.generate(sess, [5, 17, 99, 3], 3, return_state=True,
                                    temperature=0.7, seed=2)
    good = state.save(tmp_path / "good.npz")
    state.close()
    cases = _state_mutations(good, tmp_path, np.random.default_rng(SEED))
    got = run_cases(f"MODEL = {str(tiny_chat_models['int4'])!r}\n" + _LOADED,
                    [("good", f"loaded({str(good)!r})")]
                    + [(n, f"loaded({str(p)!r})") for n, p in cases],
                    timeout=400, mem_bytes=2 << 30)
    assert got.get("good", {}).get("outcome") == "ok", got.get("good", got["__exit__"])
    _check(got, {n: {"StateFileError", "ok"} for n, _ in cases}, bound=15)
    wrong = [n for n, _ in cases if got[n]["outcome"] == "ok"
             and got[n]["result"] != got["good"]["result"]]
    assert not wrong, wrong  # a load that succeeds restores exactly the saved state
    refused = sum(got[n]["outcome"] == "StateFileError" for n, _ in cases)
    assert refused >= len(cases) // 2  # the mutations mostly break the file


# ------------------------------------------------------------------------------------------------
# config extremes
# ------------------------------------------------------------------------------------------------
EXTREMES = [0, -1, 10 ** 9, 2 ** 63, "x", [], {}, None, 1.5, True, "p" * 5000 + "%d",
            {"a": [[[[1]]]]}]


def test_fuzz_config_extremes(tmp_path):
    rng = np.random.default_rng(SEED)
    genai, expect = [], {}
    fields = ["num_hidden_layers", "head_size", "num_key_value_heads", "inputs", "outputs"]
    for i in range(20):
        field = fields[i % len(fields)]
        value = EXTREMES[int(rng.integers(0, len(EXTREMES)))]
        if field in ("inputs", "outputs") and i % 2:
            sub = "past_key_names" if field == "inputs" else "present_value_names"
            value = {sub: value}
        path = _genai_folder(tmp_path / f"g{i}", {field: value})
        genai.append((f"genai{i}", f"len(olv_runtime.load({str(path)!r}).proto.graph."
                                   "persistent_bindings)"))
        expect[f"genai{i}"] = {"ModelFormatError", "ok"}
    deep = _genai_folder(tmp_path / "deep", raw='{"model": ' * 50_000 + "1" + "}" * 50_000)
    genai.append(("genai_deep", f"olv_runtime.load({str(deep)!r})"))
    expect["genai_deep"] = {"ModelFormatError"}
    base = pathlib.Path(write_gguf(tmp_path / "base.gguf", "qwen2", "F32", hidden=64, inter=128,
                                   heads=4, kv_heads=2, vocab=128))
    keys = ["qwen2.attention.head_count", "qwen2.attention.head_count_kv", "qwen2.block_count",
            "qwen2.embedding_length", "qwen2.feed_forward_length", "qwen2.attention.key_length",
            "qwen2.context_length", "qwen2.vocab_size", "tokenizer.ggml.eos_token_id"]
    ggufs = []
    for i in range(24):
        key = keys[i % len(keys)]
        value = int([0, 1, 3, 5, 2 ** 31, 2 ** 32 - 1, 10 ** 9][int(rng.integers(0, 7))])
        p = _patched(base, tmp_path / f"m{i}.gguf", key, "<I", value)
        ggufs.append((f"gguf{i}", f"olv_runtime.convert({str(p)!r}, "
                                  f"{str(tmp_path / f'o{i}' / 'm.onnx')!r}) and 1"))
        expect[f"gguf{i}"] = {"ConversionError", "ok"}
    got = run_cases("import olv_runtime", genai + ggufs, timeout=400, mem_bytes=2 << 30)
    _check(got, expect, bound=15)
    refused = sum(got[n]["outcome"] != "ok" for n in expect)
    assert refused >= len(expect) // 2


# ------------------------------------------------------------------------------------------------
# prompt length
# ------------------------------------------------------------------------------------------------
def test_fuzz_prompt_length(tiny_chat_models):
    rng = np.random.default_rng(SEED)
    cases, expect, want = [], {}, {}
    lengths = [CTX - 2, CTX - 1, CTX, CTX + 1, 1000, 207_096, 10 ** 6, 10 ** 7]
    for i in range(16):
        n = lengths[i % len(lengths)] if i < len(lengths) else int(rng.integers(CTX - 20, CTX + 20))
        m = int(rng.choice([0, 1, 5, 100, 10 ** 6]))
        cases.append((f"p{i}", f"len(olv_runtime.generate(sess, [7] * {n}, {m}, "
                               "eos_token_id=None))"))
        fits = n + (1 if m else 0) <= CTX
        expect[f"p{i}"] = {"ok"} if fits else {"ContextLengthError"}
        want[f"p{i}"] = repr(min(m, CTX - n)) if fits else None
    got = run_cases(f"import olv_runtime\nsess = olv_runtime.InferenceSession(olv_runtime.load("
                    f"{str(tiny_chat_models['int4'])!r}))", cases, timeout=400,
                    mem_bytes=2 << 30)
    _check(got, expect, bound=20)
    for name, w in want.items():
        if w is not None:
            assert got[name]["result"] == w, (name, got[name])


# ------------------------------------------------------------------------------------------------
# compiled-entry swaps
# ------------------------------------------------------------------------------------------------
IDS = np.array([[5, 17, 200, 3, 99]], np.int64)


def _logits(path, use_compiled):
    sess = olv_runtime.InferenceSession(path, olv_runtime.SessionOptions(use_compiled=use_compiled))
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    out = [state.run({"input_ids": IDS})["logits"].copy()]
    for _ in range(2):
        nxt = int(np.argmax(out[-1][0, -1]))
        out.append(state.run({"input_ids": np.array([[nxt]], np.int64)})["logits"].copy())
    return out, sess


def _shape(e) -> tuple:
    consts = {f.name: f.constant for f in e.value.struct_type.structure.field
              if f.WhichOneof("content") == "constant"}
    return tuple(int(consts[x].int64_data[0]) if consts[x].int64_data
                 else int(np.frombuffer(consts[x].raw_data, np.int64)[0]) for x in ("n", "k"))


@pytest.mark.usefixtures("module_digest_cache")
def test_fuzz_compiled_entry_swaps(tmp_path):
    ckpt = write_random_qwen2(tmp_path / "ckpt", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, vocab_size=256, with_tokenizer=False, seed=9)
    plain = tmp_path / "plain" / "model.onnx"
    olv_runtime.convert(ckpt, plain, weights="int4-block32", external_data=True)
    comp = tmp_path / "comp" / "model.onnx"
    olv_runtime.compile_model(plain, comp)
    ref, _ = _logits(comp, use_compiled=False)
    proto = pb.ModelProto()
    proto.ParseFromString(comp.read_bytes())
    groups: dict = {}
    for i, e in enumerate(proto.compiled_tensors):
        groups.setdefault(_shape(e), []).append(i)
    pairs = [(a, b) for idx in groups.values() for a in idx for b in idx if a < b]
    assert len(pairs) >= 6
    rng = np.random.default_rng(SEED)
    for case in range(6):
        a, b = pairs[int(rng.integers(0, len(pairs)))]
        d = tmp_path / f"swap{case}"
        shutil.copytree(comp.parent, d)
        p = pb.ModelProto()
        p.CopyFrom(proto)
        ea, eb = p.compiled_tensors[a], p.compiled_tensors[b]
        names = (ea.source_name, eb.source_name)
        ea.source_name, eb.source_name = names[1], names[0]
        da, db = bytes(ea.source_digest), bytes(eb.source_digest)
        ea.source_digest, eb.source_digest = db, da
        (d / "model.onnx").write_bytes(p.SerializeToString())
        got, sess = _logits(d / "model.onnx", use_compiled=True)
        for x, y in zip(got, ref):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), (case, names)
        report = {s.index: s for s in sess.compiled_report()}
        assert report[a].status == "miss" and report[b].status == "miss", (
            names, report[a], report[b])
