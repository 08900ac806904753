"""The GGUF kernels compiled for a CPU without AVX-512 (numba's target set to Haswell's features
in a fresh process, the module flag ``HOST_VNNI`` False as on such a CPU): they compile -- LLVM
exits the process if a 512-bit value reaches code built for AVX2 (the 16-lane exact tile's
ordering barrier did) -- and give the bits of the AVX-512 host's paths, exact and int8 mode, a
row count that takes the panels and a one-row leftover."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

from olv_runtime.kernels import ggml_packed as gp

HERE = pathlib.Path(__file__).resolve().parent
FEATURES = ("+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+lzcnt,+movbe,-avx512f,-avx512vl,"
            "-avx512bw,-avx512dq,-avx512cd,-avx512vnni,-avx512bf16,-avx512vbmi,-avx512vbmi2,"
            "-avx512ifma,-avx512bitalg,-avx512vpopcntdq")
CHILD = """
import sys
import olv_runtime.kernels.packed_i8 as p
p.HOST_VNNI = False  # before the kernel modules read it, as on a CPU without AVX-512 VNNI
import numpy as np
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
from test_avx2_compile import run
np.save(sys.argv[2], run())
"""


def run():
    """Exact and int8 outputs of a Q8_0 and a Q4_K weight [37, 512] for 21 activation rows."""
    from test_ggml_packed import random_blocks
    out = []
    for name in ("Q8_0", "Q4_K"):
        packed = gp.prepack_ggml(name, random_blocks(name, 37, 512, seed=3), 37, 512)
        x = np.random.default_rng(1).standard_normal((21, 512)).astype(np.float32)
        out += [gp.linear_ggml_exact(x, packed), gp.linear_ggml_i8(x, packed)]
    return np.stack(out)


def test_gguf_kernels_compile_and_agree_without_avx512(tmp_path):
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=FEATURES,
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    res = subprocess.run([sys.executable, "-c", CHILD, str(HERE), str(tmp_path / "y.npy")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    got = np.load(tmp_path / "y.npy")
    want = run()  # this process: the host's own paths (the 16-lane ones on an AVX-512 host)
    # (on a host without AVX-512 VNNI both sides run the AVX2 paths: the compile is the check)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
