"""The linears of the compiled decode step (:mod:`olv_runtime.executor.decoder_step` and
:mod:`olv_runtime.executor.paged_decoder_step`): which plan Linear steps it runs, how several
steps make one linear of the step (:class:`StackLinear`: a GGUF file's q|k|v or gate|up over
several block types), and the checks over a whole run of them (one activation mode, one INT4 scale
dtype, C-contiguous arrays; float32 INT4 scales narrowed to float16 where exact).
"""
from __future__ import annotations

import numpy as np

from olv_runtime.executor.steps import LinearStep
from olv_runtime.kernels.dispatch import LinearMode
from olv_runtime.kernels.packed_i8 import PackedInt4I8, _aligned_empty

__all__ = ["StackLinear", "consistent", "contiguous", "linear", "linear_run", "narrow_scales"]

_F32 = np.dtype(np.float32)


#: The packed modes the compiled step runs: olv's INT4 8-row groups and the ggml group
#: records (GGUF Q8_0 / Q5_0 / Q4_1 / Q5_1 / Q4_K / Q5_K / Q6_K), each with int8 or float32
#: activations.
_STEP_MODES = (LinearMode.INT8, LinearMode.EXACT, LinearMode.GGML_INT8, LinearMode.GGML_EXACT)


class StackLinear:
    """One linear of the compiled step: the plan's Linear steps computing its outputs in order
    -- one step, or several reading the same input whose weights the plan could not merge (a
    GGUF file's q|k in one block type and v in another, as llama.cpp's Q4_K_M writes them).
    Their packed weights are the linear's parts in the step's weight table
    (:class:`~olv_runtime.kernels.step_buffers.WeightTable`)."""

    def __init__(self, lins: list):
        self.lins = list(lins)
        L0 = self.lins[0]
        self.ns = [n for lin in self.lins for n in lin.ns]
        self.n = sum(self.ns)
        self.k = L0.k
        self.residual = self.lins[-1].residual
        self.quantized = L0.mode.quantized
        self.weights = [w for lin in self.lins for w in lin.weights]
        bs = [lin.bias for lin in self.lins]
        self.bias = None if all(b is None for b in bs) else np.concatenate(
            [b if b is not None else np.zeros(lin.n, np.float32) for b, lin in zip(bs, self.lins)])

    @property
    def packs(self) -> list:
        """The packed weights (parts), read when asked (:func:`narrow_scales` replaces the
        INT4 ones)."""
        return [lin.packed for lin in self.lins]

    @property
    def int4(self) -> list:
        """The INT4 :class:`~olv_runtime.kernels.packed_i8.PackedInt4I8` parts."""
        return [p for p in self.packs if type(p) is PackedInt4I8]

    def arrays(self) -> list:
        """The arrays the step reads through addresses (codes and scales, ggml records)."""
        return [a for p in self.packs for a in ((p.codes, p.scale) if type(p) is PackedInt4I8
                                                 else (p.data,))]


def linear_step(step, residual=False):
    """The LinearStep of a plan step the compiled step can run (a packed mode of
    :data:`_STEP_MODES`, symmetric INT4 or ggml records, K a multiple of 32), or None."""
    if step.kind != "Linear":
        return None
    lin = step.impl
    if not isinstance(lin, LinearStep) or lin.mode not in _STEP_MODES:
        return None
    if lin.mode in (LinearMode.INT8, LinearMode.EXACT) and type(lin.packed) is not PackedInt4I8:
        return None  # (zero-point weights, PackedInt4I8Zp, run per operator)
    if lin.residual != residual or lin.k % 32:
        return None
    return lin


def linear(step, n_out=1, residual=False):
    """A :class:`StackLinear` of one plan step with ``n_out`` outputs, or None."""
    lin = linear_step(step, residual)
    if lin is None or len(step.outputs) != n_out:
        return None
    return StackLinear([lin])


def linear_run(steps, j, inp, n_out):
    """A :class:`StackLinear` of the consecutive Linear steps from ``steps[j]`` reading only
    ``inp`` that make ``n_out`` outputs together: ``(linear, outputs, next index)`` or None.
    Every part but the last must end on a whole 8-row group (the step's groups of a linear
    run across its parts)."""
    lins, outs = [], []
    while j < len(steps) and len(outs) < n_out:
        lin = linear_step(steps[j])
        if lin is None or steps[j].inputs != (inp,):
            return None
        lins.append(lin)
        outs += steps[j].outputs
        j += 1
    if len(outs) != n_out or any(lin.n % 8 for lin in lins[:-1]):
        return None
    if len({lin.mode.quantized for lin in lins}) != 1:
        return None
    return StackLinear(lins), tuple(outs), j


def contiguous(layers, lm) -> bool:
    """Every array the step reads through an address is C-contiguous."""
    lins = [L[n] for L in layers for n in ("qkv", "o", "gu", "down")] + [lm]
    return all(a.flags.c_contiguous for lin in lins for a in lin.arrays())


def narrow_scales(layers, lm, counters=None) -> bool:
    """Store the block scales of every INT4 linear of the run as float16 when they are all
    float32 values that float16 represents exactly (e.g. onnxruntime-genai's symmetric scales
    ``absmax / -8`` of a bfloat16 checkpoint): the kernels widen float16 exactly, so every
    result is bitwise the same and each token reads 2 bytes less per 8 rows x 32 weights
    (4.5 instead of 5 bits per weight). All or none (one scale type per compiled step); the
    per-operator steps share the narrowed packed weights (ggml parts have their own scales).
    Returns True when narrowed."""
    lins = [lin for L in layers for n in ("qkv", "o", "gu", "down") for lin in L[n].lins]
    lins = [lin for lin in lins + lm.lins if type(lin.packed) is PackedInt4I8]
    if not lins or any(lin.packed.scale.dtype != _F32 for lin in lins):
        return False
    halves = []
    for lin in lins:
        sc = lin.packed.scale
        h = sc.astype(np.float16)
        if not np.array_equal(h.astype(np.float32), sc):  # NaN, out of range, more precision
            return False
        halves.append(h)
    for lin, h in zip(lins, halves):
        bits = _aligned_empty(h.shape, np.uint16)
        bits[...] = h.view(np.uint16)
        bits.flags.writeable = False
        p = lin.packed
        lin.packed = PackedInt4I8(p.codes, bits, p.n, p.k)
        if counters is not None:
            counters.add("bytes_repacked", bits.nbytes)
    return True


def consistent(layers, lm) -> bool:
    """One activation mode, one INT4 scale dtype and the same shapes in every layer."""
    L0 = layers[0]
    keys = ("heads", "kv_heads", "head_dim", "rotary_dim", "eps")
    lins = [L[n] for L in layers for n in ("qkv", "o", "gu", "down")] + [lm]
    for L in layers:
        if any(L[k] != L0[k] for k in keys):
            return False
        if L["interleaved"] != L0["interleaved"] or L["scale_attr"] != L0["scale_attr"]:
            return False
        if L["gu"].ns != L0["gu"].ns:
            return False
    if len({lin.quantized for lin in lins}) != 1:
        return False
    return len({p.scale.dtype for lin in lins for p in lin.int4}) <= 1
