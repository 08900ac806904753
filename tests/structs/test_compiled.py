"""Seed 004 compiled entries (persisted prepacked weights): wire, checker rules, loading rules.

Every cache-miss case of issue 14 is tested: the session rebuilds the packed form from the
source, says which entry missed and why (status, counter), and its results are bitwise equal to
the uncompiled model's.
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil

import numpy as np
import onnx
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.cli import main as cli_main
from olv_runtime.structs.compiled import (
    DIGEST_ALGORITHMS,
    PAYLOAD_DIGEST_KEY,
    canonical_parts,
    source_digest,
    this_device,
)
from olv_runtime.errors import CompiledTensorError
from olv_runtime.proto.helper import make_tensor
from olv_runtime.io import Model
from olv_runtime.kernels.layouts import LAYOUTS, PACKED_LAYOUT_VERSION, cpu_architecture


# this module's own verified-digest cache (never the user's): conftest.module_digest_cache
pytestmark = pytest.mark.usefixtures("module_digest_cache")


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> pathlib.Path:
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    root = tmp_path_factory.mktemp("compiled")
    ckpt = write_random_qwen2(root / "ckpt", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, vocab_size=256, with_tokenizer=False, seed=3)
    out = root / "plain" / "model.onnx"
    olv_runtime.convert(ckpt, out, weights="int4-block32", external_data=True)
    return out


@pytest.fixture(scope="module")
def compiled_dir(plain, tmp_path_factory) -> pathlib.Path:
    """A compiled copy (compile_model writes model.onnx + .data + .compiled)."""
    out = tmp_path_factory.mktemp("compiled_out") / "model.onnx"
    olv_runtime.compile_model(plain, out)
    return out.parent


def copy_compiled(compiled_dir, tmp_path) -> pathlib.Path:
    dst = tmp_path / "copy"
    shutil.copytree(compiled_dir, dst)
    return dst / "model.onnx"


IDS = np.array([[5, 17, 200, 3, 99]], np.int64)


def run_logits(path_or_model, use_compiled=True, steps=3):
    """Prefill + greedy decode logits of a fresh session, and the session."""
    sess = olv_runtime.InferenceSession(path_or_model,
                                        olv_runtime.SessionOptions(use_compiled=use_compiled))
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    out = [state.run({"input_ids": IDS})["logits"].copy()]
    for _ in range(steps):
        nxt = int(np.argmax(out[-1][0, -1]))
        out.append(state.run({"input_ids": np.array([[nxt]], np.int64)})["logits"].copy())
    return out, sess


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


def statuses(sess):
    return {(s.source_name, s.status) for s in sess.compiled_report()}


def save_proto(proto, path):
    path.write_bytes(proto.SerializeToString())
    return path


# ------------------------------------------------------------------------------------------------
# wire
# ------------------------------------------------------------------------------------------------
def test_field_numbers():
    m = pb.ModelProto.DESCRIPTOR.fields_by_name
    assert (m["struct_types"].number, m["devices"].number, m["compiled_tensors"].number) == \
        (1000, 1001, 1002)
    d = pb.DeviceProto.DESCRIPTOR.fields_by_name
    assert [d[n].number for n in ("type", "index", "architecture", "runtime", "runtime_version",
                                  "metadata_props")] == [1, 2, 3, 4, 5, 6]
    assert d["index"].has_presence
    c = pb.CompiledTensorProto.DESCRIPTOR.fields_by_name
    assert [c[n].number for n in ("source_name", "value", "device", "source_digest",
                                  "digest_algorithm", "metadata_props")] == [1, 2, 3, 4, 5, 6]
    assert c["value"].message_type.name == "EncodedValueProto"
    assert c["device"].type == c["device"].TYPE_INT32
    assert c["source_digest"].type == c["source_digest"].TYPE_BYTES
    # field 1001 / 1002 tags (varint key = number << 3 | 2)
    mp = pb.ModelProto()
    mp.devices.add(type="cpu")
    assert mp.SerializeToString()[:2] == bytes([0xCA, 0x3E])
    mp = pb.ModelProto()
    mp.compiled_tensors.add(source_name="w")
    assert mp.SerializeToString()[:2] == bytes([0xD2, 0x3E])


def test_onnx_load_keeps_every_field(compiled_dir, tmp_path):
    path = compiled_dir / "model.onnx"
    ours = olv_runtime.load(path).proto
    assert len(ours.devices) == 1 and len(ours.compiled_tensors) > 0
    om = onnx.load(str(path), load_external_data=False)
    dst = tmp_path / "roundtrip"
    dst.mkdir()
    for f in compiled_dir.iterdir():
        if f.name != "model.onnx":
            shutil.copy(f, dst / f.name)
    onnx.save(om, str(dst / "model.onnx"))
    back = olv_runtime.load(dst / "model.onnx").proto
    assert back == ours  # devices, compiled_tensors, every field
    assert back.SerializeToString() == ours.SerializeToString()
    # and the round-tripped model still hits every entry
    sess = olv_runtime.InferenceSession(dst / "model.onnx")
    assert sess.counters["compiled_misses"] == 0
    assert sess.counters["compiled_hits"] == len(ours.compiled_tensors)


# ------------------------------------------------------------------------------------------------
# digests
# ------------------------------------------------------------------------------------------------
def _dense_model(t: pb.TensorProto) -> Model:
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.graph.initializer.append(t)
    return Model(m)


def test_source_digest_covers_type_dims_content_not_name_or_storage():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = make_tensor("w", a)
    typed = pb.TensorProto(name="other", data_type=pb.TensorProto.FLOAT, dims=[3, 4])
    typed.float_data.extend(a.reshape(-1).tolist())
    d_raw = source_digest(_dense_model(raw), "w")
    assert len(d_raw) == DIGEST_ALGORITHMS["blake2b-256"] == 32
    assert source_digest(_dense_model(typed), "other") == d_raw  # name, storage method ignored
    assert source_digest(_dense_model(make_tensor("w", a.reshape(4, 3))), "w") != d_raw  # dims
    assert source_digest(_dense_model(make_tensor("w", a.astype(np.int32))), "w") != d_raw
    b = a.copy()
    b[2, 3] = 11.5
    assert source_digest(_dense_model(make_tensor("w", b)), "w") != d_raw
    with pytest.raises(CompiledTensorError, match="not supported"):
        source_digest(_dense_model(raw), "w", algorithm="md5")
    with pytest.raises(CompiledTensorError, match="resolves to 0 initializers"):
        source_digest(_dense_model(raw), "missing")


def test_source_digest_same_inline_and_external(plain, tmp_path):
    inline = tmp_path / "inline.onnx"
    olv_runtime.save(olv_runtime.load(plain), inline, external_data=False)
    name = olv_runtime.load(plain).proto.graph.encoded_initializer[1].name
    assert source_digest(plain, name) == source_digest(inline, name)
    parts = canonical_parts(olv_runtime.load(plain), name)
    assert parts[0].startswith(b"olv-canonical/1")


# ------------------------------------------------------------------------------------------------
# compile + hits
# ------------------------------------------------------------------------------------------------
def test_compiled_model_hits_every_entry_bitwise_equal(plain, compiled_dir):
    path = compiled_dir / "model.onnx"
    proto = olv_runtime.load(path).proto
    dev = proto.devices[0]
    assert (dev.type, dev.architecture, dev.runtime, dev.runtime_version) == \
        ("cpu", cpu_architecture(), "olv_runtime", PACKED_LAYOUT_VERSION)
    for e in proto.compiled_tensors:
        assert e.value.WhichOneof("layout") == "struct_type"
        assert e.value.struct_type.name in LAYOUTS
        assert e.value.data_location == pb.TensorProto.EXTERNAL
        assert e.digest_algorithm == "blake2b-256" and len(e.source_digest) == 32
    # large scales are external too: the parsed proto holds no large payload
    big = [ev for ev in proto.graph.encoded_initializer
           if ev.affine.scale.data_location == pb.TensorProto.EXTERNAL
           or len(ev.affine.scale.raw_data) >= olv_runtime.io.EXTERNAL_THRESHOLD]
    assert big and all(ev.affine.scale.data_location == pb.TensorProto.EXTERNAL for ev in big)
    ref, _ = run_logits(plain)
    got, sess = run_logits(path)
    c = sess.counters
    assert c["compiled_hits"] == len(proto.compiled_tensors) and c["compiled_misses"] == 0
    assert c["bytes_repacked"] == 0          # no source payload read for repacking
    assert c["bytes_digest_verified"] == 0   # compile recorded the verifications
    assert c["bytes_copied_other"] == 0      # merged q/k/v and gate/up are views of the file
    assert_bitwise(got, ref)
    # the uncompiled session repacks
    _, s2 = run_logits(plain, steps=0)
    assert s2.counters["bytes_repacked"] > 0 and s2.counters["compiled_hits"] == 0


def _packed_types(sess) -> list:
    import numba

    from olv_runtime.executor.steps import LinearStep
    from olv_runtime.kernels.layouts import layout_of

    out = []
    for step in sess.all_steps():
        lin = step.impl
        if isinstance(lin, LinearStep) and lin.packed is not None:
            arrays, _ = layout_of(lin.packed).parts(lin.packed)
            out.append((step.name, {k: str(numba.typeof(a)) for k, a in arrays.items()}))
    return out


def test_compiled_arrays_have_the_repacked_arrays_numba_types(plain, compiled_dir):
    # numba types a read-only array apart from a writeable one: the packed arrays of a compiled
    # session (views of the memory-mapped file) must have the types of a repacking session's,
    # or the first run of a compiled model compiles (and caches) a second kernel specialisation
    _, s_plain = run_logits(plain, steps=0)
    _, s_comp = run_logits(compiled_dir / "model.onnx", steps=0)
    assert s_comp.counters["compiled_hits"] > 0
    got, want = _packed_types(s_comp), _packed_types(s_plain)
    assert got and got == want
    assert all("readonly" in t for _, ts in got for t in ts.values())


def test_use_compiled_false_repacks(compiled_dir):
    _, sess = run_logits(compiled_dir / "model.onnx", use_compiled=False, steps=0)
    assert sess.counters["compiled_hits"] == 0 and sess.counters["bytes_repacked"] > 0
    assert sess.compiled_report() == []


def test_full_verification_and_cache_invalidation(compiled_dir, tmp_path, monkeypatch):
    path = copy_compiled(compiled_dir, tmp_path)  # a copy: new inodes, so hashed once again
    _, s1 = run_logits(path, steps=0)
    assert s1.counters["compiled_misses"] == 0 and s1.counters["bytes_digest_verified"] > 0
    _, s2 = run_logits(path, steps=0)
    assert s2.counters["bytes_digest_verified"] == 0  # cached by file identity
    monkeypatch.setenv("OLV_VERIFY_DIGESTS", "full")
    _, s3 = run_logits(path, steps=0)
    assert s3.counters["bytes_digest_verified"] > 0 and s3.counters["compiled_misses"] == 0


# ------------------------------------------------------------------------------------------------
# cache misses (acceptance list): reason, counter, bitwise equal to the uncompiled model
# ------------------------------------------------------------------------------------------------
def _plain_equivalent(path, tmp_path):
    """The same model without any compiled entry (the reference a miss must equal)."""
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    del p.devices[:]
    del p.compiled_tensors[:]
    return save_proto(p, path.parent / "reference.onnx")


def _check_miss(path, tmp_path, reason, expect_misses=None, caplog=None):
    ref, _ = run_logits(_plain_equivalent(path, tmp_path))
    with caplog.at_level(logging.DEBUG, logger="olv_runtime.structs.compiled") if caplog else \
            _nullctx():
        got, sess = run_logits(path)
    report = sess.compiled_report()
    missed = [s for s in report if s.status == "miss"]
    assert missed, "expected at least one cache miss"
    assert all(reason in s.reason for s in missed), [s.reason for s in missed]
    assert sess.counters["compiled_misses"] == len(missed)
    if expect_misses is not None:
        assert len(missed) == expect_misses
    if caplog is not None:
        assert any("cache miss" in r.message and reason in r.message for r in caplog.records)
    assert_bitwise(got, ref)
    return sess


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_miss_changed_source_tensor(compiled_dir, tmp_path, caplog):
    path = copy_compiled(compiled_dir, tmp_path)
    m = olv_runtime.load(path)
    target = m.proto.compiled_tensors[2].source_name
    ev = next(e for e in m.proto.graph.encoded_initializer if e.name == target)
    ext = {x.key: x.value for x in ev.external_data}
    data = path.parent / ext["location"]
    raw = bytearray(data.read_bytes())
    off = int(ext["offset"])
    raw[off] ^= 0x11  # two codes of the source weight change
    data.write_bytes(bytes(raw))
    sess = _check_miss(path, tmp_path, "source_digest does not match", 1, caplog)
    assert ("%s" % target, "miss") in statuses(sess)
    # and the changed model really differs from the original one (the entry was not used)
    orig, _ = run_logits(compiled_dir / "model.onnx")
    got, _ = run_logits(path)
    assert any(not np.array_equal(a, b) for a, b in zip(orig, got))


def _edit_device(path, **fields):
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    for k, v in fields.items():
        setattr(p.devices[0], k, v)
    save_proto(p, path)


def test_miss_other_architecture(compiled_dir, tmp_path, caplog):
    path = copy_compiled(compiled_dir, tmp_path)
    _edit_device(path, architecture="x86_64-avx10")
    n = len(olv_runtime.load(path).proto.compiled_tensors)
    _check_miss(path, tmp_path, "architecture 'x86_64-avx10' is not this CPU's", n, caplog)


def test_miss_other_runtime_version(compiled_dir, tmp_path, caplog):
    path = copy_compiled(compiled_dir, tmp_path)
    _edit_device(path, runtime_version=PACKED_LAYOUT_VERSION + "-old")
    n = len(olv_runtime.load(path).proto.compiled_tensors)
    _check_miss(path, tmp_path, "runtime_version", n, caplog)


def test_miss_truncated_compiled_payload(compiled_dir, tmp_path):
    path = copy_compiled(compiled_dir, tmp_path)
    comp = path.parent / "model.onnx.compiled"
    size = comp.stat().st_size
    with open(comp, "r+b") as fh:
        fh.truncate(size - 100)
    _check_miss(path, tmp_path, "truncated")


def test_miss_bit_flipped_compiled_payload(compiled_dir, tmp_path):
    path = copy_compiled(compiled_dir, tmp_path)
    m = olv_runtime.load(path)
    e = m.proto.compiled_tensors[0]
    ext = {x.key: x.value for x in e.value.external_data}
    comp = path.parent / "model.onnx.compiled"
    raw = bytearray(comp.read_bytes())
    raw[int(ext["offset"]) + 7] ^= 0x04
    comp.write_bytes(bytes(raw))
    sess = _check_miss(path, tmp_path, "digest of the compiled bytes", 1)
    assert sess.compiled_report()[0].status == "miss"


def test_miss_unknown_physical_type(compiled_dir, tmp_path, caplog):
    path = copy_compiled(compiled_dir, tmp_path)
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    p.compiled_tensors[1].value.struct_type.name = "vendor.TiledInt4x16"
    save_proto(p, path)
    _check_miss(path, tmp_path, "unknown physical type 'vendor.TiledInt4x16'", 1, caplog)


def test_miss_wrong_shape_and_missing_digest_metadata(compiled_dir, tmp_path):
    path = copy_compiled(compiled_dir, tmp_path)
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    del p.compiled_tensors[0].metadata_props[:]
    save_proto(p, path)
    _check_miss(path, tmp_path, PAYLOAD_DIGEST_KEY, 1)


def test_miss_with_zero_copy_siblings_repacks_the_group(compiled_dir, tmp_path):
    # q_proj misses: the merged q/k/v weight is repacked, k and v are reported unused
    path = copy_compiled(compiled_dir, tmp_path)
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    q = next(e for e in p.compiled_tensors if e.source_name.endswith("layers.0.self_attn.q_proj.weight"))
    q.value.struct_type.name = "olv.Unknown"
    save_proto(p, path)
    sess = _check_miss(path, tmp_path, "unknown physical type", 1)
    st = {s.source_name.split(".", 1)[1]: s for s in sess.compiled_report()}
    assert st["layers.0.self_attn.k_proj.weight"].status == "unused"
    assert "sibling" in st["layers.0.self_attn.k_proj.weight"].reason


# ------------------------------------------------------------------------------------------------
# checker rules (seed 004 "Validation"): each a CompiledTensorError at session creation
# ------------------------------------------------------------------------------------------------
def _mutated(compiled_dir, tmp_path, fn):
    path = copy_compiled(compiled_dir, tmp_path)
    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    fn(p)
    return save_proto(p, path)


def _dup_entry(p):
    p.compiled_tensors.add().CopyFrom(p.compiled_tensors[0])


def _dup_device(p):
    p.devices.add().CopyFrom(p.devices[0])


def _affine_value(p):
    ev = p.graph.encoded_initializer[1]
    p.compiled_tensors[0].value.Clear()
    p.compiled_tensors[0].value.affine.CopyFrom(ev.affine)


def _unconstrained(p):
    v = p.compiled_tensors[0].value
    v.struct_type.Clear()
    v.struct_type.name = "x"


def _bad_length(p):
    v = p.compiled_tensors[0].value
    for x in v.external_data:
        if x.key == "length":
            x.value = str(int(x.value) - 1)


def _dup_meta(p):
    p.compiled_tensors[0].metadata_props.add(key=PAYLOAD_DIGEST_KEY, value="00")


def _dup_device_meta(p):
    p.devices[0].metadata_props.add(key="a", value="1")
    p.devices[0].metadata_props.add(key="a", value="2")


def _unresolved_ref(p):
    v = p.compiled_tensors[0].value
    v.struct_type.Clear()
    v.struct_type.type_ref = 4242


CHECKER_CASES = {
    "device index out of range": (lambda p: setattr(p.compiled_tensors[0], "device", 1),
                                  "device index 1 is out of range"),
    "negative device index": (lambda p: setattr(p.compiled_tensors[0], "device", -1),
                              "device index -1 is out of range"),
    "two entries for one key": (_dup_entry, "same cache key"),
    "duplicate device descriptors": (_dup_device, "must be unique"),
    "missing source": (lambda p: setattr(p.compiled_tensors[0], "source_name", "nope"),
                       "resolves to 0 initializers"),
    "empty digest": (lambda p: p.compiled_tensors[0].ClearField("source_digest"),
                     "source_digest is empty"),
    "empty algorithm": (lambda p: p.compiled_tensors[0].ClearField("digest_algorithm"),
                        "digest_algorithm is empty"),
    "digest length": (lambda p: setattr(p.compiled_tensors[0], "source_digest", b"\1" * 5),
                      "has 5 bytes"),
    "affine value": (_affine_value, "exact structured value"),
    "unconstrained type": (_unconstrained, "unconstrained category"),
    "unresolved type_ref": (_unresolved_ref, "does not resolve"),
    "payload size": (_bad_length, "not a whole positive number"),
    "duplicate entry metadata": (_dup_meta, "appears more than once"),
    "duplicate device metadata": (_dup_device_meta, "appears more than once"),
}


@pytest.mark.parametrize("case", sorted(CHECKER_CASES))
def test_checker_rule(compiled_dir, tmp_path, case):
    fn, pattern = CHECKER_CASES[case]
    path = _mutated(compiled_dir, tmp_path, fn)
    with pytest.raises(CompiledTensorError, match=pattern):
        olv_runtime.InferenceSession(path)


def test_unknown_digest_algorithm_is_a_miss_not_an_error(compiled_dir, tmp_path):
    path = _mutated(compiled_dir, tmp_path,
                    lambda p: setattr(p.compiled_tensors[0], "digest_algorithm", "blake3"))
    _check_miss(path, tmp_path, "digest algorithm 'blake3' is not supported", 1)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def test_cli_compile_and_inspect(plain, tmp_path, capsys):
    out = tmp_path / "cli" / "model.onnx"
    assert cli_main(["compile", str(plain), str(out)]) == 0
    text = capsys.readouterr().out
    assert "compiled entries for cpu:" + cpu_architecture() in text
    assert cli_main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "device 0: type 'cpu'" in text and cpu_architecture() in text
    assert ": hit" in text and ": miss" not in text
    _edit_device(out, architecture="arm64-sve")
    assert cli_main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert ": miss (architecture 'arm64-sve'" in text
    # a checker error is reported as an error
    path = _mutated(out.parent, tmp_path / "m2", _dup_entry)
    assert cli_main(["inspect", str(path)]) == 2
    assert "same cache key" in capsys.readouterr().err


def test_compile_in_place_replaces_this_devices_entries(compiled_dir, tmp_path):
    path = copy_compiled(compiled_dir, tmp_path)
    n = len(olv_runtime.load(path).proto.compiled_tensors)
    olv_runtime.compile_model(path, path)
    p = olv_runtime.load(path).proto
    assert len(p.devices) == 1 and len(p.compiled_tensors) == n
    _, sess = run_logits(path, steps=0)
    assert sess.counters["compiled_hits"] == n


def test_this_device():
    d = this_device()
    assert d.type == "cpu" and d.runtime == "olv_runtime"
    assert d.architecture.split("-")[-1] in ("avx512vnni", "avx2", "generic")


def test_gguf_q4_0_model_compiles_and_hits(tmp_path):
    # struct-typed (ggml block) sources repacked at session creation: the entry's digest is the
    # digest of the GGUF block payload, the results equal the uncompiled model's
    from gguf_models import write_gguf

    src = write_gguf(tmp_path / "m.gguf", "qwen2", "Q4_0", layers=1, hidden=64, inter=128,
                     vocab=256, tokenizer=False)
    conv = tmp_path / "g" / "model.onnx"
    olv_runtime.convert(src, conv)
    out = tmp_path / "gc" / "model.onnx"
    rep = olv_runtime.compile_model(conv, out)
    assert rep.entries > 0
    for e in olv_runtime.load(out).proto.compiled_tensors:
        assert len(e.source_digest) == 32
    ref, _ = run_logits(conv, steps=2)
    got, sess = run_logits(out, steps=2)
    assert sess.counters["compiled_hits"] == rep.entries
    assert sess.counters["compiled_misses"] == 0
    assert_bitwise(got, ref)


def _rss_of_mapping(path: pathlib.Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    import re

    total, cur = 0, None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                cur = parts[5] if len(parts) > 5 else ""
            elif line.startswith("Rss:") and cur == str(path):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_decode_does_not_touch_source_pages_of_prepacked_weights(tmp_path):
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    ckpt = write_random_qwen2(tmp_path / "ckpt", hidden_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=1024, vocab_size=256, with_tokenizer=False,
                              seed=5)
    plain = tmp_path / "plain" / "model.onnx"
    olv_runtime.convert(ckpt, plain, weights="int4-block32", external_data=True)
    comp = tmp_path / "comp" / "model.onnx"
    olv_runtime.compile_model(plain, comp)
    proto = olv_runtime.load(comp).proto
    packed_sources = {e.source_name for e in proto.compiled_tensors}
    prepacked_bytes = codes_bytes = 0  # source payloads (codes + external scales) / codes only
    for ev in proto.graph.encoded_initializer:
        if ev.name in packed_sources:
            for msg in (ev, ev.affine.scale):
                if msg.data_location == pb.TensorProto.EXTERNAL:
                    n = int({x.key: x.value for x in msg.external_data}["length"])
                    prepacked_bytes += n
                    codes_bytes += n if msg is ev else 0
    results = {}
    for name, path in (("plain", plain), ("compiled", comp)):
        sess = olv_runtime.InferenceSession(path)
        olv_runtime.generate(sess, [1, 2, 3, 4, 5], 6)
        results[name] = _rss_of_mapping(path.parent / "model.onnx.data")
        del sess
    # the uncompiled session reads every source byte to repack; the compiled one only the
    # embedding rows, norms and biases (+ the kernel's fault-around of a few 64 KiB windows)
    assert results["plain"] >= 0.9 * codes_bytes  # its scales are inline
    assert results["compiled"] < 0.4 * prepacked_bytes, (results, prepacked_bytes)


@pytest.mark.parametrize("ttype", ["Q4_0", "Q8_0"])
def test_compile_gguf_import_keeps_the_gguf_in_place(tmp_path, ttype):
    """``olv compile`` of a converted GGUF file next to it references the .gguf as the import
    does (no tensor copied into a .data file); a model with nothing to persist says why."""
    from gguf_models import write_gguf

    from olv_runtime.models.compile import compile_model

    gg = write_gguf(tmp_path / "m.gguf", "qwen2", ttype, layers=1, seed=4)
    olv_runtime.convert(gg, tmp_path / "m.onnx")
    rep = compile_model(tmp_path / "m.onnx", tmp_path / "c.onnx")
    data = tmp_path / "c.onnx.data"
    assert not data.exists() or data.stat().st_size == 0
    assert rep.entries > 0 or rep.skipped  # written entries, or the reasons there are none
    ids = [5, 17, 99, 3]
    want = olv_runtime.generate(olv_runtime.load(tmp_path / "m.onnx"), ids, 6)
    got = olv_runtime.generate(olv_runtime.load(tmp_path / "c.onnx"), ids, 6)
    assert got.tolist() == want.tolist()


# ------------------------------------------------------------------------------------------------
# recognized sources: weights the graph makes of plain integer initializers (DequantizeLinear
# over INT4 codes, MatMulNBits B): source_name is the codes initializer and the digest covers the
# scale / zero-point initializers too, so changing any of them is a miss, never a stale hit
# ------------------------------------------------------------------------------------------------
def _scale_initializer_of(proto, source):
    """Name of the scale initializer the DequantizeLinear / MatMulNBits node over ``source``
    reads."""
    for n in proto.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] == source:
            return n.input[1]
        if n.op_type == "MatMulNBits" and n.input[1] == source:
            return n.input[2]
    raise AssertionError(f"no quantized-weight node over {source!r}")


def _double_scale(path, name):
    """Rewrite ``path`` with the scale initializer ``name`` doubled (inline in the proto)."""
    from onnx import numpy_helper

    m = olv_runtime.load(path)
    p = pb.ModelProto()
    p.CopyFrom(m.proto)
    t = next(t for t in p.graph.initializer if t.name == name)
    arr = np.array(olv_runtime.structs.initializers.tensor_from_proto(t, m.payload(t)
                   if t.data_location == pb.TensorProto.EXTERNAL or t.HasField("raw_data")
                   else None))
    new = numpy_helper.from_array(arr * 2, name)
    t.Clear()
    t.MergeFromString(new.SerializeToString())
    return save_proto(p, path)


def _run_standard(path):
    """Logits of a standard export (KV as graph inputs: an empty past), and the session."""
    import json

    from olv_runtime.builder.export import FEEDBACK_METADATA_KEY

    sess = olv_runtime.InferenceSession(path)
    pairs = json.loads(sess.get_modelmeta()[FEEDBACK_METADATA_KEY])
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    feeds = {"input_ids": IDS}
    for p in pairs:
        kvh, d = shapes[p["input"]][1], shapes[p["input"]][3]
        feeds[p["input"]] = np.zeros((1, kvh, 0, d), np.float32)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return outs["logits"], sess


def test_standard_export_compiles_hits_and_misses_on_changed_scales(plain, tmp_path, caplog):
    """olv export-standard output (INT4 initializers under DequantizeLinear): compiled entries
    name the INT4 initializers; a changed scale initializer is a source_digest miss whose results
    equal the uncompiled changed model."""
    from olv_runtime.builder.export import export_standard

    std = tmp_path / "std" / "model.onnx"
    std.parent.mkdir()
    olv_runtime.save(export_standard(plain, feedback=True), std)
    out = tmp_path / "stdc" / "model.onnx"
    rep = olv_runtime.compile_model(std, out)
    assert rep.entries > 0 and not rep.skipped
    proto = olv_runtime.load(out).proto
    inits = {t.name: t for t in proto.graph.initializer}
    for e in proto.compiled_tensors:
        assert inits[e.source_name].data_type in (pb.TensorProto.INT4, pb.TensorProto.UINT4)
    ref, _ = _run_standard(std)
    got, sess = _run_standard(out)
    assert sess.counters["compiled_hits"] == rep.entries
    assert sess.counters["compiled_misses"] == 0
    assert_bitwise([got], [ref])
    # double one weight's scales: its entry misses, nothing else does; the results are those of
    # the same changed model without compiled entries
    target = proto.compiled_tensors[1].source_name
    _double_scale(out, _scale_initializer_of(proto, target))
    with caplog.at_level(logging.DEBUG, logger="olv_runtime.structs.compiled"):
        changed, sess = _run_standard(out)
    missed = [s for s in sess.compiled_report() if s.status == "miss"]
    assert [s.source_name for s in missed] == [target]
    assert "source_digest does not match" in missed[0].reason
    assert sess.counters["compiled_misses"] == 1
    assert any("cache miss" in r.message and target in r.message for r in caplog.records)
    reference, _ = _run_standard(_plain_equivalent(out, tmp_path))
    assert_bitwise([changed], [reference])
    assert not np.array_equal(changed, got)


@pytest.mark.parametrize("zero_points", [False, True])
def test_matmul_nbits_model_compiles_hits_and_misses_on_changed_scales(tmp_path, zero_points):
    """A MatMulNBits weight (onnxruntime's MatMulNBitsQuantizer): the entry names B, hits with
    bitwise-equal results, and misses when the scales initializer changes."""
    import onnx
    from onnx import helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(7 + zero_points)
    n, k = 64, 128
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", pb.TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", pb.TensorProto.FLOAT, [None, n])],
                          [onnx.numpy_helper.from_array(w, "w")])
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)],
                                               ir_version=10),
                             bits=4, block_size=32, is_symmetric=not zero_points)
    q.process()
    src = tmp_path / "mnb.onnx"
    onnx.save(q.model.model, src)
    out = tmp_path / "c" / "mnb.onnx"
    rep = olv_runtime.compile_model(src, out)
    assert rep.entries == 1 and not rep.skipped
    proto = olv_runtime.load(out).proto
    node = next(nd for nd in proto.graph.node if nd.op_type == "MatMulNBits")
    assert proto.compiled_tensors[0].source_name == node.input[1]
    x = rng.standard_normal((3, k)).astype(np.float32)

    def run(path):
        sess = olv_runtime.InferenceSession(path)
        return sess.run(None, {"x": x})[0], sess

    ref, _ = run(src)
    got, sess = run(out)
    assert (sess.counters["compiled_hits"], sess.counters["compiled_misses"]) == (1, 0)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    _double_scale(out, node.input[2])
    got2, sess = run(out)
    assert (sess.counters["compiled_hits"], sess.counters["compiled_misses"]) == (0, 1)
    assert "source_digest does not match" in sess.compiled_report()[0].reason
    assert np.array_equal(got2.view(np.uint32), (2 * ref).view(np.uint32))
