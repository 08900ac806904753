"""The steady decode program of a session (:class:`DecodeProgram`): a one-token call of a decoder
whose plan is ``[EncodedGather, RotaryPositions, DecoderStack]`` runs those three steps directly,
without the plan loop's per-step bookkeeping; :class:`_SlotPlan` maps the KV pairs of the plan's
steps. Built by :meth:`InferenceSession.decode_program`."""
from __future__ import annotations

import numpy as np

from olv_runtime import kernels
from olv_runtime import pool as pool_mod
from olv_runtime.errors import InvalidArgument, ValidationError, node_failed
from olv_runtime.executor.decoder_step import DecoderStack
from olv_runtime.executor.positions import RotaryPositions
from olv_runtime.executor.steps import LAST_ONLY
from olv_runtime.ops.olv import EncodedGather

_I64 = np.dtype(np.int64)


class _SlotPlan:
    """The plan's values as list slots, fixed once: ``template`` holds the constants the steps
    (or the graph outputs) read, every other slot None; ``slot`` maps a value name to its slot
    (graph inputs included); ``steps`` is ``(step, input slots, output slots, released slots)``
    per step (slot -1: an omitted output; a name-less input reads the slot of ``""``, always
    None); ``outputs`` the graph outputs' ``(name, slot)``. ``step.fn`` is read at every run
    (tests and benchmarks replace it)."""

    __slots__ = ("template", "slot", "steps", "outputs", "_pairs")

    def __init__(self, steps, constants, input_infos, output_names):
        slot: dict[str, int] = {"": 0}
        template: list = [None]

        def at(name: str) -> int:
            i = slot.get(name)
            if i is None:
                i = slot[name] = len(template)
                template.append(constants[name] if name in constants and name not in input_infos
                                else None)
            return i

        for name in input_infos:
            at(name)
        for name in input_infos:  # an input with an initializer: its default unless fed
            if name in constants:
                template[slot[name]] = constants[name]
        plan = []
        for st in steps:
            ins = tuple(at(n) for n in st.inputs)
            outs = tuple(at(n) if n else -1 for n in st.outputs)
            rel = tuple(slot[n] for n in st.release if n in slot)
            plan.append((st, ins, outs, rel))
        self.outputs = tuple((n, at(n)) for n in output_names)
        self.template = template
        self.slot = slot
        self.steps = tuple(plan)
        self._pairs: dict = {}

    def kv_pairs(self, step, k: int) -> tuple:
        """``(output name, input name)`` of a :class:`~olv_runtime.executor.steps.KVAppended` step's KV
        values: its outputs after the ``k`` pooled ones and its last inputs, in order."""
        key = (id(step), k)
        got = self._pairs.get(key)
        if got is None or got[0] is not step:
            outs = step.outputs[k:]
            ins = step.inputs[len(step.inputs) - len(outs):]
            got = self._pairs[key] = (step, tuple(zip(outs, ins)))
        return got[1]


class DecodeProgram:
    """A steady decode token of a plan of the converter's decoder form, run without the
    executor's per-step bookkeeping: ``[EncodedGather(ids) -> x, RotaryPositions(past_0, ids) ->
    cos, sin, DecoderStack(x, cos, sin, pasts...) -> logits, presents...]`` (every graph output
    made by the stack). :meth:`run` takes the token's ids (int64 [1, 1]) and the stack's KV
    values of the last call (a :class:`~olv_runtime.executor.decoder_step.KVSpan` or the arrays) and
    returns the logits and the new span, or None when the call is not the steady one (the
    caller then runs the plan generically). The values are those of the executor's run: the
    same step objects compute them (``one_token``, ``rows``, ``steady_run``), the pool serves
    the buffers and the same counters are counted; a step whose ``fn`` was replaced (tests,
    benchmarks) sends every call to the executor.

    Attributes
    ----------
    feed : str
        The ids input.
    kv_inputs, kv_outputs : tuple of str
        The stack's past inputs and present outputs, in its KV order.
    pairs : tuple
        The stack's ``(output, input)`` KV pairs, the object :meth:`InferenceSession.run_env`
        reports for its in-place appends.
    """

    def __init__(self, session, steps, pairs):
        self.session = session
        self.steps = steps
        g, r, s = steps
        self.feed = g.inputs[0]
        self.kv_inputs = tuple(s.inputs[3:])
        self.kv_outputs = tuple(s.outputs[1:])
        self.logits = s.outputs[0]
        self.pairs = pairs

    @staticmethod
    def build(session) -> "DecodeProgram | None":
        steps = session._steps
        if len(steps) != 3:
            return None
        g, r, s = steps
        if not (type(g.impl) is EncodedGather and type(r.impl) is RotaryPositions
                and type(s.impl) is DecoderStack):
            return None  # (a step whose fn is replaced is checked at every run)
        stack, rope = s.impl, r.impl
        if stack.rope_table or rope.paged or len(g.inputs) != 1 or len(g.outputs) != 1:
            return None
        ids = g.inputs[0]
        if (ids not in session._input_name_set or len(s.inputs) < 4 or len(r.inputs) != 2
                or r.inputs != (s.inputs[3], ids) or s.inputs[0] != g.outputs[0]
                or tuple(s.inputs[1:3]) != tuple(r.outputs)):
            return None
        if any(n not in session._input_name_set for n in s.inputs[3:]):
            return None
        if sorted(session._output_names) != sorted(s.outputs) or len(set(s.outputs)) != len(s.outputs):
            return None
        if g.impl.w.shape[1] != stack.e or rope.r2 != stack.rotary_dim // 2:
            return None
        return DecodeProgram(session, (g, r, s), session._slot_plan().kv_pairs(s, 1))

    def run(self, ids: np.ndarray, kv):
        """One token: ``(logits float32 [1, 1, V], KVSpan)`` or None (see the class docstring)."""
        g, r, s = self.steps
        if g.fn is not g.impl or r.fn is not r.impl or s.fn is not s.impl:
            return None
        if ids.shape != (1, 1) or ids.dtype != _I64:
            return None
        sess = self.session
        sess.model.check_external_files()  # PayloadError if a mapped file changed
        n = sess.options.num_threads
        if n is not None:  # numba's thread count is per calling thread: this session's
            n = int(n)
            kernels.config.thread_count_fns()[0](n)
        stack = s.impl
        t = stack.steady_begin(kv, n)  # claims slot t of every KV buffer
        if t is None:
            return None
        sess.counters.add("runs", 1)
        pool = sess._pools.pool if hasattr(sess._pools, "pool") else sess.buffer_pool()
        prev = pool_mod.activate(pool)
        token = LAST_ONLY.set(frozenset()) if LAST_ONLY.get() else None
        ok = False
        step = g
        try:
            x0 = g.impl.one_token(ids)
            step = r
            cos, sin = r.impl.rows(t)
            step = s
            logits, span = stack.steady_run(x0, cos, sin, t)
            pool.escape_one(logits)
            pool.end_run()
            ok = True
        except (InvalidArgument, ValidationError):
            raise
        except Exception as exc:
            raise node_failed(step, exc) from exc
        finally:
            if token is not None:
                LAST_ONLY.reset(token)
            pool_mod.restore(prev)
            if not ok:
                pool.abort_run()
        return logits, span
