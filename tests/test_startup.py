"""Warm start (issue 14): what a plain load -> session -> generate imports, and numba's deferred
BLAS probe (olv_runtime.kernels.numba_startup).

The import graph is checked in a fresh interpreter (this test process has imported everything):
modules whose import costs tens to hundreds of milliseconds and that decoding a compiled model
does not need must not be imported by it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import olv_runtime

#: never imported by import olv_runtime -> load -> InferenceSession -> generate
NOT_IMPORTED = ("onnx", "onnx.defs", "scipy.linalg", "numpy.f2py", "olv_runtime.builder",
                "olv_runtime.models.hf", "transformers", "jinja2", "tokenizers", "torch",
                "olv_runtime.structs.ggml", "olv_runtime.ops.com_microsoft",
                "olv_runtime.kv.paged", "olv_runtime.state.files",
                "olv_runtime.kernels.packed_zp",
                "ml_dtypes")  # 0.1-0.9 s to import; only bfloat16 values need it

_CHILD = r"""
import json, sys
import olv_runtime
model = olv_runtime.load(sys.argv[1])
sess = olv_runtime.InferenceSession(model)
# the compiled decode step's kernels are imported by the first decode step, not before
deferred = "olv_runtime.kernels.decoder_layers" not in sys.modules
ids = olv_runtime.generate(sess, [5, 17, 200, 3], 2)
import numba.np.arraymath as am
print(json.dumps({"modules": sorted(sys.modules), "hits": sess.counters["compiled_hits"],
                  "deferred": deferred,
                  "probe": type(am._HAVE_BLAS).__name__, "ids": [int(i) for i in ids]}))
"""


@pytest.fixture(scope="module")
def compiled_model(tmp_path_factory):
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    root = tmp_path_factory.mktemp("startup")
    ckpt = write_random_qwen2(root / "ckpt", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, vocab_size=256, with_tokenizer=False, seed=3)
    plain = root / "plain" / "model.onnx"
    olv_runtime.convert(ckpt, plain, weights="int4-block32", external_data=True)
    out = root / "compiled" / "model.onnx"
    olv_runtime.compile_model(plain, out)
    return out


def test_decoding_a_compiled_model_imports_no_heavy_module(compiled_model):
    r = subprocess.run([sys.executable, "-c", _CHILD, str(compiled_model)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["hits"] > 0 and len(got["ids"]) == 2
    mods = set(got["modules"])
    assert not [m for m in NOT_IMPORTED if m in mods]
    assert "numba.np.arraymath" in mods and got["probe"] == "LazyProbe"
    assert got["deferred"] and "olv_runtime.kernels.decoder_layers" in mods


def test_deferred_blas_probe_gives_numbas_answer():
    import numba.np.arraymath as am

    from olv_runtime.kernels.numba_startup import LazyProbe

    assert isinstance(am._HAVE_BLAS, LazyProbe)
    try:
        import scipy.linalg.cython_blas  # noqa: F401
        have = True
    except ImportError:
        have = False
    assert bool(am._HAVE_BLAS) is have      # numba's own probe, run on first use
    assert am.ensure_blas is __import__("numba.np.linalg", fromlist=["x"]).ensure_blas


def test_lazy_probe_runs_once():
    from olv_runtime.kernels.numba_startup import LazyProbe

    calls = []
    p = LazyProbe(lambda: calls.append(1) or True)
    assert "not probed" in repr(p)
    assert p and p and not calls[1:]
    assert repr(p) == "LazyProbe(True)"


def test_models_package_is_lazy():
    """Loading a model reads an onnxruntime-genai folder's config (olv_runtime.io.genai): that
    must not pull in the converters, the graph builder and onnx; the models package then gives
    the converter's names."""
    code = ("import sys, olv_runtime.io.genai;"
            "a = 'olv_runtime.models' in sys.modules or 'olv_runtime.models.hf' in sys.modules;"
            "b = 'onnx' in sys.modules;"
            "import olv_runtime.models as m;"
            "print(a, b, m.convert.__module__, m.hf.__name__, 'onnx' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False", "olv_runtime.models.hf", "olv_runtime.models.hf",
                                "True"]


def test_bfloat16_tables_import_ml_dtypes_when_first_needed():
    """bfloat16 (GGUF BF16 fields, helper tensors) works in a fresh interpreter although
    ``import olv_runtime`` no longer imports ml_dtypes."""
    code = ("import sys, olv_runtime\n"
            "from olv_runtime.proto import TensorProto as T\n"
            "from olv_runtime.structs.layout import LEAF_TYPES\n"
            "from olv_runtime.proto.helper import np_dtype_to_tensor_type, tensor_type_to_np_dtype\n"
            "before = 'ml_dtypes' in sys.modules\n"
            "bits, kind, dt = LEAF_TYPES[T.BFLOAT16]\n"
            "import ml_dtypes\n"
            "print(before, T.BFLOAT16 in LEAF_TYPES, bits, kind, dt == ml_dtypes.bfloat16,\n"
            "      tensor_type_to_np_dtype(T.BFLOAT16) == ml_dtypes.bfloat16,\n"
            "      np_dtype_to_tensor_type(ml_dtypes.bfloat16) == T.BFLOAT16,\n"
            "      LEAF_TYPES.get(12345))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True", "16", "float", "True", "True", "True", "None"]
