"""Issue 26 item 4: a compiled entry is bound to its source.

An entry whose payload was made for another weight of the same shape (the k_proj and v_proj
entries of one layer with ``source_name`` / ``source_digest`` swapped) must be a cache miss, and
the session's results bitwise equal to the uncompiled model's: ``olv.payload_digest`` covers the
entry's source name, source digest and name as well as the compiled bytes
(olv_runtime.structs.compiled.payload_parts).
"""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.structs.compiled import _hash_parts, payload_parts
from olv_runtime.models.random_checkpoint import write_random_qwen2

pytestmark = pytest.mark.usefixtures("module_digest_cache")

IDS = np.array([[5, 17, 200, 3, 99]], np.int64)


@pytest.fixture(scope="module")
def compiled_path(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("binding")
    ckpt = write_random_qwen2(root / "ckpt", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, vocab_size=256, with_tokenizer=False, seed=5)
    plain = root / "plain" / "model.onnx"
    olv_runtime.convert(ckpt, plain, weights="int4-block32", external_data=True)
    out = root / "compiled" / "model.onnx"
    olv_runtime.compile_model(plain, out)
    return out


def _logits(path, use_compiled=True, steps=3):
    sess = olv_runtime.InferenceSession(path, olv_runtime.SessionOptions(use_compiled=use_compiled))
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    out = [state.run({"input_ids": IDS})["logits"].copy()]
    for _ in range(steps):
        nxt = int(np.argmax(out[-1][0, -1]))
        out.append(state.run({"input_ids": np.array([[nxt]], np.int64)})["logits"].copy())
    return out, sess


def _copy(path: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "copy"
    shutil.copytree(path.parent, dst)
    return dst / path.name


def _swap_k_v(proto: pb.ModelProto, fields=("source_name", "source_digest")) -> int:
    """Swap ``fields`` between the k_proj and v_proj entries of every layer; returns the number
    of entries touched."""
    by_name = {e.source_name: e for e in proto.compiled_tensors}
    touched = 0
    for name, k in list(by_name.items()):
        if not name.endswith("self_attn.k_proj.weight"):
            continue
        v = by_name[name.replace("k_proj", "v_proj")]
        for f in fields:
            a, b = getattr(k, f), getattr(v, f)
            setattr(k, f, b)
            setattr(v, f, a)
        touched += 2
    return touched


def test_entries_hit_when_untouched(compiled_path):
    got, sess = _logits(compiled_path)
    report = sess.compiled_report()
    assert report and all(s.status == "hit" for s in report), \
        [(s.source_name, s.status, s.reason) for s in report]


def test_swapped_same_shape_entries_are_misses_and_bitwise_equal(compiled_path, tmp_path):
    path = _copy(compiled_path, tmp_path)
    p = pb.ModelProto()
    p.ParseFromString(path.read_bytes())
    # k_proj and v_proj really have the same shape (else a shape check would catch the swap)
    shapes = {}
    for e in p.compiled_tensors:
        consts = {f.name: f.constant for f in e.value.struct_type.structure.field
                  if f.WhichOneof("content") == "constant"}
        shapes[e.source_name] = tuple(int(consts[x].int64_data[0]) if consts[x].int64_data
                                      else int(np.frombuffer(consts[x].raw_data, np.int64)[0])
                                      for x in ("n", "k"))
    k0 = next(n for n in shapes if n.endswith("layers.0.self_attn.k_proj.weight"))
    assert shapes[k0] == shapes[k0.replace("k_proj", "v_proj")]
    touched = _swap_k_v(p)
    assert touched == 4
    path.write_bytes(p.SerializeToString())

    ref, _ = _logits(compiled_path, use_compiled=False)
    got, sess = _logits(path)
    for a, b in zip(got, ref):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    report = {s.source_name: s for s in sess.compiled_report()}
    swapped = [n for n in report if "k_proj" in n or "v_proj" in n]
    assert len(swapped) == 4
    for n in swapped:
        assert report[n].status == "miss", (n, report[n].status)
        assert "digest of the compiled bytes" in report[n].reason
    assert sess.counters["compiled_misses"] == 4
    # the other entries are unaffected (q_proj of the merged q/k/v group is repacked with them)
    others = [s for n, s in report.items() if n not in swapped]
    assert all(s.status == "hit" for s in others if "q_proj" not in s.source_name)


def test_swapped_payload_references_are_misses(compiled_path, tmp_path):
    # the other direction: each entry keeps its name and digests, its payload is the other's
    path = _copy(compiled_path, tmp_path)
    p = pb.ModelProto()
    p.ParseFromString(path.read_bytes())
    by_name = {e.source_name: e for e in p.compiled_tensors}
    k = by_name[next(n for n in by_name if n.endswith("layers.1.self_attn.k_proj.weight"))]
    v = by_name[k.source_name.replace("k_proj", "v_proj")]
    kv, vv = pb.EncodedValueProto(), pb.EncodedValueProto()
    kv.CopyFrom(k.value)
    vv.CopyFrom(v.value)
    k.value.CopyFrom(vv)
    v.value.CopyFrom(kv)
    k.value.name, v.value.name = kv.name, vv.name
    path.write_bytes(p.SerializeToString())
    ref, _ = _logits(compiled_path, use_compiled=False)
    got, sess = _logits(path)
    for a, b in zip(got, ref):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    report = {s.source_name: s for s in sess.compiled_report()}
    assert report[k.source_name].status == "miss"
    assert report[v.source_name].status == "miss"


def test_payload_digest_covers_name_and_source_digest():
    body = [np.arange(64, dtype=np.uint8)]
    base = _hash_parts(payload_parts("a.weight", b"\1" * 32, "a.weight/compiled", body),
                       "blake2b-256")[0]
    for args in [("b.weight", b"\1" * 32, "a.weight/compiled"),
                 ("a.weight", b"\2" * 32, "a.weight/compiled"),
                 ("a.weight", b"\1" * 32, "b.weight/compiled"),
                 # length-prefixed: moving bytes between fields changes the digest
                 ("a.weight\0", b"\1" * 31, "a.weight/compiled")]:
        assert _hash_parts(payload_parts(*args, body), "blake2b-256")[0] != base
    # and the compiled bytes alone (format 1) are not what is covered any more
    assert _hash_parts(body, "blake2b-256")[0] != base

