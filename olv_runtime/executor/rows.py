"""The session's plan run over rows of many sequences at once (the batching engine's forward).

:func:`rows_program` reads an :class:`~olv_runtime.executor.session.InferenceSession`'s plan and,
when it has the form of the olv converter's decoder (olv's own models and GGUF-converted ones:
``EncodedGather(input_ids)``, the fused rotary positions, per layer ``Attention`` or the fused
``RopeAttention`` over the layer's ``past_key.i``/``past_value.i``, every other step row-wise, a
linear ``logits``), returns a :class:`RowsProgram`. Its :meth:`RowsProgram.forward` runs the plan
once for ``R`` rows taken from any number of sequences -- decode rows and prompt chunks together,
each row at its own position -- with three substitutions:

* the positions subgraph gives each row the cos/sin of its own position (one table row per
  position, made once by the same numpy operations as :meth:`RotaryPositions.rows`, so a row's
  values never depend on the rows beside it);
* each attention writes the rows' rotated keys and values into the engine's block pool
  (:class:`olv_runtime.kv.block_pool.KVBlockPool`) and attends each row over its own sequence's
  blocks (:mod:`olv_runtime.kernels.row_attention`);
* the ``logits`` linear runs on the rows that need logits only (the last row of each sequence).

Every other step runs as in :meth:`InferenceSession.run`, over ``[1, R, ...]``: the linears are
one GEMM over the R rows (the weights read once per step), and their kernels compute each row
independently of the others (tested), so a row's result is bitwise the same whatever else is in
the step. Steps whose arithmetic depends on the number of rows -- BLAS matrix products: dense
float32 linears, ``MatMul``/``Gemm`` nodes, the offset term of INT4-plane GGUF linears; and the
row-major INT4 kernel of other block sizes -- run one row at a time (:data:`ROW_DEPENDENT`), so
the promise holds for them too, at the cost of reading their weights once per row.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from olv_runtime import kernels
from olv_runtime.errors import InvalidArgument
from olv_runtime.lazy import lazy_module

# the compiled rows step (numba kernels): imported at the engine's first step, not with the session
rows_layers = lazy_module("olv_runtime.kernels.rows_layers")

__all__ = ["ROW_DEPENDENT", "RowsProgram", "rows_program"]

#: Step kinds whose output rows depend on how many rows the call has (BLAS blocking); the rows
#: program runs them one row at a time. A fused linear is such a step when its kernel is
#: "dense" (BLAS) or "row_major" (:func:`~olv_runtime.kernels.linear.linear_int4`).
ROW_DEPENDENT = frozenset({"MatMul", "Gemm"})


def _row_dependent(step) -> bool:
    if step.kind == "Linear":
        return getattr(step.impl, "kernel", None) in ("dense", "row_major")
    return step.kind in ROW_DEPENDENT


def _per_row(fn, args, r: int) -> tuple:
    """``fn`` on each row of its ``[1, R, ...]`` arguments (other arguments as they are); the
    outputs concatenated along the row axis."""
    outs = []
    for i in range(r):
        sub = [a[:, i:i + 1] if isinstance(a, np.ndarray) and a.ndim == 3 and a.shape[:2] == (1, r)
               else a for a in args]
        outs.append(fn(*sub))
    return tuple(np.concatenate([o[k] for o in outs], axis=1) for k in range(len(outs[0])))

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


class _Attn:
    """One attention of the plan: input names (q, k, v), output name, rope ops (fused form)."""

    __slots__ = ("h", "k", "kvh", "layer", "out", "q", "rope_k", "rope_q", "scale", "v")

    def __init__(self, layer, q, k, v, out, rope_q, rope_k, h, kvh, scale):
        self.layer, self.q, self.k, self.v, self.out = layer, q, k, v, out
        self.rope_q, self.rope_k = rope_q, rope_k
        self.h, self.kvh, self.scale = h, kvh, scale


def _flat_steps(session) -> list:
    out = []
    for s in session._steps:
        if s.kind in ("DecoderStack",):
            out.extend(s.impl.sub_steps)
        else:
            out.append(s)
    return out


def _past_layer(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    return int(tail) if tail.isdigit() else None


def rows_program(session) -> tuple[RowsProgram | None, str]:
    """``(RowsProgram, "")`` when the session's plan has the converter's decoder form, else
    ``(None, reason)`` -- the reason names the first step or value that does not fit."""
    steps = _flat_steps(session)
    consts = session._constants
    inputs = set(session.input_infos)
    if "input_ids" not in inputs or "logits" not in session.output_names:
        return None, "the model has no input_ids input or no logits output"
    produced = {"input_ids"}
    ops = []
    attns = []
    positions = None
    for s in steps:
        if s.kind == "RotaryPositions":
            if positions is not None or getattr(s.impl, "paged", False):
                return None, f"step {s.name!r}: a second or paged positions step"
            positions = s.impl
            produced.update(s.outputs)
            continue
        if s.kind in ("RopeAttention", "Attention"):
            a = _attention(s, len(attns), positions)
            if isinstance(a, str):
                return None, a
            for n in (a.q, a.k, a.v):
                if n not in produced:
                    return None, f"step {s.name!r}: input {n!r} is not computed by the plan"
            attns.append(a)
            ops.append(("attn", a))
            produced.add(a.out)
            continue
        for n in s.inputs:
            if n and n not in produced and n not in consts:
                return None, (f"step {s.name!r} ({s.kind}) reads {n!r}, which is neither computed "
                              f"from input_ids nor a constant")
        if "logits" in s.outputs:
            if (s.kind != "Linear" or len(s.outputs) != 1
                    or getattr(s.impl, "residual", False)):
                return None, f"the logits step {s.name!r} is a {s.kind}, not a plain linear"
            ops.append(("logits-rows" if _row_dependent(s) else "logits", s))
        else:
            ops.append(("step-rows" if _row_dependent(s) else "step", s))
        produced.update(o for o in s.outputs if o)
    if positions is None:
        return None, "the plan has no fused rotary positions step"
    if not attns or "logits" not in produced:
        return None, "the plan has no attention or computes no logits"
    for i, a in enumerate(attns):
        if a.layer != i:
            return None, f"attention {i} reads the past of layer {a.layer}"
    kvh, h = attns[0].kvh, attns[0].h
    info = session.input_infos.get("past_key.0")
    dims = [d.dim_value for d in info.type.tensor_type.shape.dim] if info is not None else []
    if len(dims) != 4 or dims[3] <= 0 or any(a.kvh != kvh or a.h != h for a in attns):
        return None, "the layers' KV geometry could not be read from past_key.0 [B, KVH, T, D]"
    prog = RowsProgram(session, ops, positions, len(attns), h, kvh, int(dims[3]))
    prog.compiled = _compiled_rows(session, ops, positions, prog)
    return prog, ""


def _compiled_rows(session, ops, positions, prog):
    """The :class:`CompiledRows` of a plan whose layers are one olv-form ``DecoderStack`` step
    (the compiled one-token step's weights) after the steps making its embedding input, or
    None. Not for a stack with q/k head norms (Qwen3): the rows step
    (:mod:`olv_runtime.kernels.rows_layers`) has none, so such a plan's rows run per operator."""
    stacks = [s for s in session._steps if s.kind == "DecoderStack"]
    if len(stacks) != 1 or session._steps[-1] is not stacks[0]:
        return None
    st = stacks[0]
    stack = st.impl
    if (getattr(stack, "rope_table", True) or type(stack).__name__ != "DecoderStack"
            or not stack.int4_only or getattr(stack, "qk_norm", False)
            or st.outputs[0] != "logits" or tuple(st.inputs[1:3]) != tuple(positions.outputs)
            or stack.rotary_dim // 2 != positions.r2
            or (stack.n_layers, stack.heads, stack.kv_heads, stack.head_dim)
            != (prog.n_layers, prog.n_heads, prog.n_kv_heads, prog.head_dim)):
        return None
    inner = {id(s) for s in stack.sub_steps}
    pre = []
    for kind, x in ops:
        if kind == "attn" or id(x) in inner:
            break
        pre.append((kind, x))
    made = {n for _, x in pre for n in x.outputs}
    if st.inputs[0] not in made:
        return None
    return CompiledRows(stack, pre, st.inputs[0])


class CompiledRows:
    """The rows of a step through one compiled forward (:mod:`olv_runtime.kernels.rows_layers`)
    with the weights of the plan's fused ``DecoderStack``: ``pre`` the plan steps making the
    embedding ``x0`` from ``input_ids``."""

    def __init__(self, stack, pre, x0_name):
        self.stack, self.pre, self.x0_name = stack, pre, x0_name
        #: the embedding's ``one_token(ids [1, 1]) -> float32 [1, 1, E]`` when ``pre`` is that
        #: one gather (:class:`~olv_runtime.ops.olv.EncodedGather`), else None
        self.one_token = None
        if len(pre) == 1 and pre[0][0] == "step" and tuple(pre[0][1].inputs) == ("input_ids",) \
                and tuple(pre[0][1].outputs) == (x0_name,):
            self.one_token = getattr(pre[0][1].fn, "one_token", None)
        self._local = threading.local()  # a workspace per calling thread (engines may share)
        self._bundles = None
        self.tasks = 0  # tasks of the last call (1: the serial program)

    def workspace(self, r: int, nt: int, bs: int):
        """This thread's workspace for ``r`` rows and ``nt`` tasks (grown to a power of two >= 16
        rows)."""
        ws = getattr(self._local, "ws", None)
        if ws is None or ws.r_max < r or ws.nt != nt or ws.att[5].shape[1] != bs:
            st = self.stack
            r_max = max(16, 1 << (int(r) - 1).bit_length())
            ws = self._local.ws = rows_layers.RowsWorkspace(
                nt, r_max, st.e, st.biases.shape[1], st.heads, st.kv_heads, st.head_dim,
                st.inter, st.k_max, bs)
        return ws

    def bundles(self):
        """``(StepWeights, StepDims)`` of the stack (made once; the ISA choice re-read)."""
        st = self.stack
        vnni = rows_layers.packed_i8.use_vnni()
        b = self._bundles
        if b is None or b[1].vnni != vnni:
            sb = rows_layers
            w = st.weights
            b = self._bundles = (
                sb.StepWeights(w.wt, w.codes0, w.scale0, st.biases, st.has_bias, st.norms,
                               st.eps),
                sb.StepDims(st.heads, st.kv_heads, st.head_dim, st.rotary_dim, st.interleaved,
                            st.att_scale, st.inter, vnni))
        return b


def _attention(s, index, positions):
    """The :class:`_Attn` of a RopeAttention / Attention step, or the reason it does not fit."""
    if s.kind == "RopeAttention":
        impl = s.impl
        att = impl.attention
        if not impl.fast or not impl.causal:
            return f"step {s.name!r}: a RopeAttention the row program does not take"
        q, k, v, pk, pv, cq, sq, ck, sk = s.inputs
        if positions is None or (cq, sq) != positions.outputs or (ck, sk) != positions.outputs:
            return f"step {s.name!r}: its cos/sin are not the positions step's"
        rope_q, rope_k = impl.rope_q, impl.rope_k
        h, kvh, scale = impl.h, impl.kvh, impl.scale_attr
    else:
        att = s.impl
        at = att.attrs
        q, k, v = s.inputs[:3]
        if len(s.inputs) < 6 or (len(s.inputs) > 3 and s.inputs[3]):
            return f"step {s.name!r}: an Attention with a mask or without a past"
        pk, pv = s.inputs[4], s.inputs[5]
        if not at.get("is_causal") or at.get("softcap", 0.0) or at.get("qk_matmul_output_mode", 0):
            return f"step {s.name!r}: a non-causal or soft-capped Attention"
        rope_q = rope_k = None
        h, kvh, scale = at["q_num_heads"], at["kv_num_heads"], at["scale"]
    layer = _past_layer(pk, "past_key.")
    if layer is None or _past_layer(pv, "past_value.") != layer:
        return f"step {s.name!r}: its past is not past_key.i / past_value.i"
    if not h or not kvh or h % kvh:
        return f"step {s.name!r}: {h} query heads over {kvh} kv heads"
    return _Attn(layer, q, k, v, s.outputs[0], rope_q, rope_k, int(h), int(kvh), scale)


class RowsProgram:
    """A session's plan over rows of many sequences (see the module docstring).

    Attributes
    ----------
    n_layers, n_heads, n_kv_heads, head_dim : int
        The KV geometry a pool for this program must have.
    """

    def __init__(self, session, ops, positions, n_layers, h, kvh, d):
        self.session = session
        self.ops = ops
        self.positions = positions
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, h, kvh, d
        #: the compiled forward (:class:`CompiledRows`) where the plan has one fused decoder
        #: stack, else None; ``use_compiled = False`` runs the per-operator plan instead
        self.compiled = None
        self.use_compiled = True
        self._table = np.empty((0, positions.r2), _F32), np.empty((0, positions.r2), _F32)
        self._lock = threading.Lock()
        consts = session._constants
        self._const = consts
        # the last op reading each value: it is dropped after that op (a chunk of 512 rows keeps
        # one layer's intermediates, not all of them)
        last = {}
        for i, (kind, x) in enumerate(ops):
            names = (x.q, x.k, x.v) if kind == "attn" else x.inputs
            for n in names:
                if n and n not in consts:
                    last[n] = i
        self._drop = [[] for _ in ops]
        for n, i in last.items():
            self._drop[i].append(n)

    @property
    def embedding_rows(self) -> int | None:
        """Rows of the embedding table ``input_ids`` index (the ids a row may hold are
        ``[0, embedding_rows)``), when the plan's gather of ``input_ids`` says it; else None."""
        for kind, x in self.ops:
            if kind == "step" and tuple(x.inputs) == ("input_ids",):
                shape = getattr(getattr(x.fn, "w", None), "shape", None)
                if shape is not None and len(shape) == 2 and int(shape[0]) > 0:
                    return int(shape[0])
                return None
        return None

    # -- positions ------------------------------------------------------------------------------
    def _rope_rows(self, pos: np.ndarray):
        """cos, sin float32 [1, R, D/2] of each row's position (a table grown one position at a
        time, as :meth:`RotaryPositions.rows` makes them: a row's values never depend on the
        rows beside it)."""
        need = int(pos.max()) + 1 if pos.size else 0
        cos_t, sin_t = self._table
        if need > cos_t.shape[0]:
            with self._lock:
                cos_t, sin_t = self._table
                if need > cos_t.shape[0]:
                    n = max(need, 2 * cos_t.shape[0], 256)
                    inv_row = self.positions.inv_row
                    r2 = self.positions.r2
                    nc, ns = np.empty((n, r2), _F32), np.empty((n, r2), _F32)
                    nc[:cos_t.shape[0]] = cos_t
                    ns[:sin_t.shape[0]] = sin_t
                    ti = np.empty((1, 1), _I64)
                    pf = np.empty((1, 1), _F32)
                    freqs = np.empty((1, r2), _F32)
                    for u in range(cos_t.shape[0], n):
                        ti[0, 0] = u
                        np.copyto(pf, ti, casting="unsafe")
                        np.multiply(pf, inv_row, out=freqs)
                        np.cos(freqs, out=nc[u:u + 1])
                        np.sin(freqs, out=ns[u:u + 1])
                    self._table = cos_t, sin_t = nc, ns
        r = pos.shape[0]
        if r == 1:  # a decode step at B = 1: a view of the table's row (no gather)
            p = int(pos[0])
            return cos_t[p:p + 1].reshape(1, 1, -1), sin_t[p:p + 1].reshape(1, 1, -1)
        return cos_t[pos].reshape(1, r, -1), sin_t[pos].reshape(1, r, -1)

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, pos: np.ndarray, row_seq: np.ndarray, tables: np.ndarray,
                blocks: np.ndarray, offsets: np.ndarray, logit_rows: np.ndarray,
                pool) -> np.ndarray:
        """Run ``R`` rows; returns float32 logits ``[len(logit_rows), vocab]``.

        Parameters
        ----------
        ids : int64 [R]
            Token id of each row.
        pos : int64 [R]
            Position of each row in its sequence.
        row_seq : int32 [R]
            Row of ``tables`` (the sequence) of each row.
        tables : int32 [S, MB]
            Block table per sequence; the blocks of positions ``0..pos`` must be in it.
        blocks, offsets : int64 [R]
            Pool block and row within it where each row's keys/values go (``tables[row_seq[r],
            pos[r] // BS]`` and ``pos[r] % BS``).
        logit_rows : int64 [n]
            The rows whose logits are returned, in this order.
        pool : KVBlockPool
            With this program's geometry.

        Raises
        ------
        InvalidArgument
            Arrays of the wrong dtype or length; a pool of another geometry.
        """
        r = ids.shape[0]
        for name, a, dt in (("ids", ids, _I64), ("pos", pos, _I64), ("blocks", blocks, _I64),
                            ("offsets", offsets, _I64)):
            if a.dtype != dt or a.shape != (r,):
                raise InvalidArgument(f"RowsProgram.forward: {name} must be {dt} [{r}], got "
                                      f"{a.dtype} {list(a.shape)}")
        if (pool.n_layers, pool.kv_heads, pool.head_dim) != (self.n_layers, self.n_kv_heads,
                                                             self.head_dim):
            raise InvalidArgument(
                f"RowsProgram.forward: the pool has {pool.n_layers} layers x {pool.kv_heads} kv "
                f"heads x {pool.head_dim}, the model {self.n_layers} x {self.n_kv_heads} x "
                f"{self.head_dim}")
        session = self.session
        session.model.check_external_files()
        if session.options.num_threads is not None:
            kernels.config.thread_count_fns()[0](int(session.options.num_threads))
        if self.compiled is not None and self.use_compiled:
            return self._forward_compiled(ids, pos, row_seq, tables, blocks, offsets, logit_rows,
                                          pool)
        consts = self._const
        env = {"input_ids": ids.reshape(1, r)}
        cos, sin = self._rope_rows(pos)
        env[self.positions.outputs[0]] = cos
        env[self.positions.outputs[1]] = sin
        logits = None
        for i, (kind, x) in enumerate(self.ops):
            if kind == "attn":
                env[x.out] = self._attend(x, env, cos, sin, r, pos, row_seq, tables, blocks,
                                          offsets, pool)
            else:
                last = kind.startswith("logits")
                if last and not len(logit_rows):  # prompt chunks only: no lm_head
                    logits = np.empty((0, 0), _F32)
                    continue
                args = [env[n] if n in env else consts[n] if n else None for n in x.inputs]
                if last:
                    args[0] = np.ascontiguousarray(args[0][:, logit_rows])
                if kind.endswith("-rows"):
                    res = _per_row(x.fn, args, args[0].shape[1])
                else:
                    res = x.fn(*args)
                for n, v in zip(x.outputs, res):
                    if n:
                        env[n] = v
                if last:
                    logits = res[0]
            for n in self._drop[i]:
                env.pop(n, None)
        return logits.reshape(len(logit_rows), -1) if len(logit_rows) else logits

    def _forward_compiled(self, ids, pos, row_seq, tables, blocks, offsets, logit_rows, pool):
        """:meth:`forward` through :class:`CompiledRows` (one compiled call for the layers)."""
        r = ids.shape[0]
        nb, bs = pool.n_blocks, pool.block_size
        # the compiled code indexes without bounds checks: every index is checked here
        if (row_seq.dtype != np.int32 or row_seq.shape != (r,) or tables.dtype != np.int32
                or tables.ndim != 2 or logit_rows.dtype != _I64 or logit_rows.ndim != 1):
            raise InvalidArgument(
                f"RowsProgram.forward: row_seq int32 [{r}], tables int32 [S, MB], logit_rows "
                f"int64 [n] expected, got {row_seq.dtype} {list(row_seq.shape)}, {tables.dtype} "
                f"{list(tables.shape)}, {logit_rows.dtype} {list(logit_rows.shape)}")
        if r and not rows_layers.indices_ok(pos, row_seq, tables, blocks, offsets, logit_rows,
                                            nb, bs):
            bad = []
            if int(pos.min()) < 0 or int(pos.max()) // bs >= tables.shape[1]:
                bad.append(f"a position ({int(pos.min())}..{int(pos.max())}) outside the block "
                           f"table ({tables.shape[1]} blocks of {bs})")
            if int(row_seq.min()) < 0 or int(row_seq.max()) >= tables.shape[0]:
                bad.append(f"a row_seq outside 0..{tables.shape[0] - 1}")
            if tables.size and (int(tables.min()) < 0 or int(tables.max()) >= nb):
                bad.append(f"a table entry outside the pool's {nb} blocks")
            if int(blocks.min()) < 0 or int(blocks.max()) >= nb:
                bad.append(f"a block outside the pool's {nb} blocks")
            if int(offsets.min()) < 0 or int(offsets.max()) >= bs:
                bad.append(f"an offset outside 0..{bs - 1}")
            if logit_rows.size and (int(logit_rows.min()) < 0 or int(logit_rows.max()) >= r):
                bad.append(f"a logit row outside 0..{r - 1}")
            raise InvalidArgument("RowsProgram.forward: " + ("; ".join(bad)
                                                             or "an index outside its range"))
        c = self.compiled
        st = c.stack
        consts = self._const
        if r == 1 and c.one_token is not None:
            # one row (a decode step at B = 1): the embedding's one-token call, as generate's
            # decode program makes it (same values and errors; this thread's scratch row, read
            # by the call below before anything else overwrites it)
            x0 = c.one_token(ids.reshape(1, 1)).reshape(1, st.e)
        else:
            env = {"input_ids": ids.reshape(1, r)}
            for kind, x in c.pre:
                args = [env[n] if n in env else consts[n] if n else None for n in x.inputs]
                res = _per_row(x.fn, args, r) if kind.endswith("-rows") else x.fn(*args)
                for n, v in zip(x.outputs, res):
                    if n:
                        env[n] = v
            x0 = np.ascontiguousarray(env[c.x0_name], dtype=_F32).reshape(r, st.e)
        cos, sin = self._rope_rows(pos)
        logits = np.empty((len(logit_rows), st.vocab), _F32)
        nt = c.tasks = st._task_count()
        ws = c.workspace(r, nt, bs)
        w, dims = c.bundles()
        # one row per sequence (decode rows): step 3 fused into the attention tasks
        fused = bool(r == tables.shape[0] and (r < 2 or np.unique(row_seq).size == r))
        batch = rows_layers.RowBatch(x0, cos.reshape(r, -1), sin.reshape(r, -1), pos, row_seq,
                                     tables, blocks, offsets, logit_rows, logits, fused)
        rows_layers.rows_forward(nt, st.quant, batch, ws, rows_layers.pool_bundle(pool, ws), w,
                                 dims)
        pool.bytes_written += r * pool.bytes_per_token()
        return logits

    def _attend(self, a: _Attn, env, cos, sin, r, pos, row_seq, tables, blocks, offsets, pool):
        q, k, v = env[a.q], env[a.k], env[a.v]
        if a.rope_q is not None:
            q = a.rope_q.run(q, cos, sin)[0]
            k = a.rope_k.run(k, cos, sin)[0]
        h, kvh = a.h, a.kvh
        d = self.head_dim
        if q.shape[-1] != h * d or k.shape[-1] != kvh * d or v.shape[-1] != kvh * d:
            raise InvalidArgument(f"layer {a.layer}: q/k/v widths {q.shape[-1]}/{k.shape[-1]}/"
                                  f"{v.shape[-1]} disagree with {h}/{kvh} heads of {d}")
        q3 = np.ascontiguousarray(q, dtype=_F32).reshape(r, h, d)
        k3 = np.ascontiguousarray(k, dtype=_F32).reshape(r, kvh, d)
        v3 = np.ascontiguousarray(v, dtype=_F32).reshape(r, kvh, d)
        pool.write(a.layer, blocks, offsets, k3, v3)
        scale = a.scale if a.scale is not None else 1.0 / math.sqrt(d)
        out = np.empty((r, h, d), _F32)
        pool.attend(a.layer, q3, tables, row_seq, pos, float(np.float32(scale)), out)
        return out.reshape(1, r, h * d)
