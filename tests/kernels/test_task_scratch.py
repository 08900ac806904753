"""Per-task scratch of the compiled steps sits on cache lines of its own (packed_i8.task_scratch).

Two tasks writing one 64-byte line make the cores take turns owning it (false sharing): the
engine's exact-mode accumulators lost 20 % of an 8-row step to it while ``np.zeros`` started
them 16 bytes into a line. These tests check the layout (a property of the buffers, not a
timing): every task's block of every per-task scratch array written in the kernels' loops starts
on a line and holds whole lines, so no line has two writers.
"""
from __future__ import annotations

import numpy as np
import pytest

from olv_runtime.kernels import packed_f32, packed_i8
from olv_runtime.kernels.ggml_packed import make_workspace_ggml
from olv_runtime.kernels.packed_i8 import task_scratch
from olv_runtime.kernels.rows_layers import RowsWorkspace
from olv_runtime.kernels.step_buffers import StackWorkspace

LINE = 64


def _own_lines(a: np.ndarray, name: str) -> None:
    """Task t's block ``a[t]`` starts on a line and the next task's block starts a line later
    than its last byte (no line holds bytes of two tasks)."""
    nt = a.shape[0]
    for t in range(nt):
        start = a[t].ctypes.data
        assert start % LINE == 0, f"{name}[{t}] starts {start % LINE} bytes into a line"
        if t + 1 < nt:
            last = start + (a[t].size - 1) * a.itemsize  # a row is contiguous
            assert a[t].flags.c_contiguous or a[t].ndim == 1
            assert last // LINE < a[t + 1].ctypes.data // LINE, (
                f"{name}: tasks {t} and {t + 1} share a line")


@pytest.mark.parametrize("tail,dtype", [((1, 8), np.float32), ((64,), np.float32), ((7,), np.float32),
                                        ((7, 80), np.float32), ((5, 3), np.int64), ((3,), np.int8),
                                        ((14, 64), np.int8)])
@pytest.mark.parametrize("nt", [1, 2, 3])
def test_task_scratch_blocks_are_whole_lines(nt, tail, dtype):
    for _ in range(4):  # several allocations: np.zeros' offset into a line varies
        a = task_scratch(nt, tail, dtype)
        assert a.dtype == dtype and a.shape[0] == nt and a.flags.c_contiguous
        assert a.shape[1] >= tail[0] and a.shape[2:] == tail[1:]
        assert not a.any()
        _own_lines(a, f"task_scratch{tail}")
        b = task_scratch(nt, tail, dtype, pad=False)
        assert b.shape == (nt,) + tail and b.ctypes.data % LINE == 0 and not b.any()


def test_task_scratch_pads_the_first_dimension_only_as_needed():
    assert task_scratch(2, (64,), np.float32).shape == (2, 64)      # 256 bytes: whole lines
    assert task_scratch(2, (7,), np.float32).shape == (2, 16)       # 28 -> 64 bytes
    assert task_scratch(2, (7, 80), np.float32).shape == (2, 7, 80)  # 320-byte rows: 5 lines
    assert task_scratch(2, (7, 20), np.float32).shape == (2, 8, 20)  # 80-byte rows: fours
    assert task_scratch(2, (1, 8), np.float32).shape == (2, 2, 8)


def test_rows_workspace_scratch_on_own_lines():
    ws = RowsWorkspace(2, 16, 64, 96, 4, 2, 16, 128, 128, 16)
    _own_lines(ws.rs.facc32, "facc32")
    _own_lines(ws.i8[3], "facc8")
    for i, a in enumerate(ws.att):
        _own_lines(a, f"att[{i}]")
    assert ws.att[5].shape == (2, 16, 16) and ws.att[7].shape == (2, 16)  # shapes kept


def test_stack_workspace_scratch_on_own_lines():
    ws = StackWorkspace(2, 64, 96, 64, 256, 128, 100, 128)
    _own_lines(ws.facc8, "facc8")
    _own_lines(ws.facc32, "facc32")
    for i, a in enumerate(ws.attention(4, 2, 16)):
        if i != 3:  # attn_p: written once per layer, a whole row per task
            _own_lines(a, f"attention[{i}]")
    for i, a in enumerate(ws.paged(16, 64, 2, 16, 4)):
        _own_lines(a, f"paged[{i}]")
    _own_lines(ws.ggml_buffers(True)[2], "ggml facc")


def test_kernel_workspaces_scratch_on_own_lines():
    _own_lines(packed_f32.make_workspace_f32(8, 64, 2).facc, "f32 facc")
    _own_lines(packed_i8.make_workspace_i8(8, 64, 2).facc, "i8 facc")
    _own_lines(make_workspace_ggml(8, 256, 2).facc, "ggml facc")
