"""InferenceSession: validate a model once, build an execution plan, run it with numba kernels.

The API mirrors onnxruntime (``run(output_names, feeds)``, ``get_inputs()``, ``get_outputs()``).
At creation the session

1. reads dense initializers as numpy views of the payload and encoded initializers as validated
   :class:`~olv_runtime.structs.initializers.AffineValue` views (no decoding, no payload copy);
2. resolves each node's implementation by (domain, op_type, opset) — an unsupported operator fails
   here, naming it;
3. orders nodes topologically and checks every input is available; a tensor-only operator that
   would receive an encoded value fails here (seed 000: "A tensor-only op never receives an
   encoded value implicitly");
4. fuses ``olv.Decode -> Transpose -> MatMul`` (and ``Transpose -> MatMul`` of a dense constant)
   into one linear kernel over the stored ``[N, K]`` weight, and ``olv.Decode -> Gather`` into a
   row gather that decodes only the requested rows; the float weight is never materialised;
5. computes value lifetimes so intermediate arrays are released after their last use.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import types
from typing import Any, Mapping, Sequence

import numpy as np

from olv_runtime import kernels
from olv_runtime import pool as pool_mod
from olv_runtime.counters import Counters
from olv_runtime.decoding import resolve as resolve_encoded
from olv_runtime.decoding.ggml_native import (
    GGMLGather,
    GGMLWeight,
    linear_weight,
)
from olv_runtime.errors import (
    InvalidArgument,
    MissingDecoderError,
    UnsupportedOperatorError,
    ValidationError,
    node_failed,
)
from olv_runtime.executor.decoder_step import prestart_precompile
from olv_runtime.executor.options import MAX_KV_CAPACITY, MAX_KV_GROWTH, SessionOptions  # noqa: F401
from olv_runtime.executor.passes import optimize
from olv_runtime.executor.program import DecodeProgram, _SlotPlan
from olv_runtime.executor.rows import rows_program
from olv_runtime.executor.steps import (
    LAST_ONLY,
    EncodedGather,
    KVAppended,
    KVResults,
    LinearStep,
    Step,
    last_position_args,
    prepare_linears,
    release_repacks,
)
from olv_runtime.executor.tensors import (  # noqa: F401
    TensorSpec,
    as_array,
    check_tensor,
    tensor_spec,
    type_string,
)
from olv_runtime.io import Model, as_model
from olv_runtime.kernels import precompile
from olv_runtime.kv.contiguous import committed_length
from olv_runtime.ops import control, lookup  # noqa: F401  (control: If, local functions)
from olv_runtime.ops.registry import canonical_domain
from olv_runtime.ops.schema_outputs import OUTPUTS, output_range
from olv_runtime.pool import BufferPool
from olv_runtime.proto import EncodedValueProto, TensorProto, ValueInfoProto
from olv_runtime.proto.helper import declared_shape
from olv_runtime.structs import StructValue
from olv_runtime.structs.compiled import CompiledEntries
from olv_runtime.structs.initializers import (
    NP_DTYPE,
    SUBBYTE,
    AffineValue,
    dtype_name,
    param_tensor,
    tensor_from_proto,
)
from olv_runtime.structs.recognize import (
    from_dequantize_linear,
    gather_table,
    mark_source,
)
from olv_runtime.structs.recognize import linear_weight as affine_linear_weight
from olv_runtime.structs.runtime import check_struct_value

#: Operators whose schema accepts an encoded value as input (everything else is tensor-only).
ENCODED_CONSUMERS = {("olv", "Decode")}


@dataclasses.dataclass(frozen=True)
class NodeArg:
    """Name, type string and shape of a graph input or output (as onnxruntime's NodeArg).

    ``shape`` holds ints for fixed dims and strings (dim_param) or None for symbolic ones.
    """

    name: str
    type: str
    shape: list


class InferenceSession:
    """Run any supported ONNX(+seed 000) graph: ``run(output_names, feeds)``.

    Parameters
    ----------
    model : Model, ModelProto, onnx.ModelProto or path
        The model. It must stay unchanged while the session lives (it is never re-read,
        hashed or serialized after creation).
    options : SessionOptions, optional

    Raises
    ------
    UnsupportedOperatorError
        A node's (domain, op_type, version) is not implemented.
    MissingDecoderError
        An encoded value reaches a consumer with no decoder.
    ValidationError
        Malformed graph (missing value, cycle, duplicate names, bad initializer or attribute).
    """

    def __init__(self, model, options: SessionOptions | None = None):
        self.model: Model = as_model(model)
        self.options = options or SessionOptions()
        self.counters = Counters()
        self._pools = threading.local()
        if self.options.num_threads is not None:
            kernels.set_num_threads(int(self.options.num_threads))
        proto = self.model.proto
        graph = proto.graph
        self._opsets = {canonical_domain(o.domain): int(o.version) for o in proto.opset_import}
        if "" not in self._opsets:
            raise ValidationError("model has no opset_import for the standard ONNX domain")
        self._opsets_view = types.MappingProxyType(self._opsets)
        self._constants: dict[str, Any] = {}
        resolved = resolve_encoded(self.model, self.counters)  # seed 000 layer + seed 004 checker
        self._encoded_values = resolved.values
        self.compiled = None  # seed 004 compiled entries (persisted prepacked weights)
        if self.options.use_compiled and proto.compiled_tensors:
            self.compiled = CompiledEntries(self.model, resolved.compiled_roots, self.counters)
        self._load_constants(graph)
        self._inputs = [vi for vi in graph.input if vi.name not in self._constants]
        self._input_infos = {vi.name: vi for vi in graph.input}
        self._input_infos_view = types.MappingProxyType(self._input_infos)
        self._specs = {name: tensor_spec(vi) for name, vi in self._input_infos.items()}
        self._symbolic_dims = [  # (input, axis, dim_param) of every named symbolic dimension
            (name, axis, d) for name, spec in self._specs.items() if spec.kind == "tensor_type"
            for axis, d in enumerate(spec.shape or ()) if isinstance(d, str)
        ]
        groups: dict[str, list] = {}
        for name, axis, d in self._symbolic_dims:
            groups.setdefault(d, []).append((name, axis))
        self._symbolic_groups = list(groups.values())  # (input, axis) pairs per dim_param
        self._symbolic_groups_t = tuple(tuple(g) for g in self._symbolic_groups)
        self._input_name_set = frozenset(vi.name for vi in self._inputs)
        self._check_input_types()
        self._outputs = list(graph.output)
        self._output_names = [o.name for o in self._outputs]
        self._output_names_t = tuple(self._output_names)
        prestarted = False
        if self.options.compiled_decode:  # cold numba cache: a compile worker starts now
            prestarted = prestart_precompile(graph)
        try:
            self._steps = self._plan(graph)
        finally:
            if prestarted:  # the plan's stack gave it its job, or it exits now
                precompile.release_idle()

        release_repacks(self._encoded_values.values(), self._steps)
        self._strided_ok = self._strided_inputs(graph)

    # -- construction --------------------------------------------------------------------
    def _check_input_types(self) -> None:
        """Graph inputs the runtime cannot be fed fail here, naming the type (a sequence,
        optional or map input; a tensor element type numpy cannot hold: BFLOAT16, FLOAT8*,
        INT4/UINT4/INT2/UINT2, STRING, complex)."""
        for vi in self._inputs:
            spec = self._specs[vi.name]
            if spec.kind == "struct_type":
                continue
            if spec.kind != "tensor_type":
                raise ValidationError(
                    f"graph input {vi.name!r} has type {spec.kind or 'unset'}; only tensor and "
                    "struct inputs are supported"
                )
            if spec.dtype is None:
                raise ValidationError(
                    f"graph input {vi.name!r}: element type {dtype_name(spec.elem_type)} is not "
                    "supported (supported: "
                    + ", ".join(sorted(dtype_name(t) for t in NP_DTYPE)) + ")"
                )

    def _load_constants(self, graph) -> None:
        seen: dict[str, str] = {}

        def claim(name: str, kind: str) -> None:
            if not name:
                raise ValidationError(f"a {kind} initializer has an empty name")
            if name in seen:
                raise ValidationError(
                    f"initializer name {name!r} is used by both a {seen[name]} and a {kind} "
                    "initializer (names are unique across dense, sparse and encoded initializers)"
                )
            seen[name] = kind

        self._initializer_protos: dict[str, TensorProto] = {}
        self._initializer_payloads: dict[str, np.ndarray] = {}
        self.constant_types: dict[str, int] = {}  # initializer name -> TensorProto data type
        self._recognized: set[str] = set()  # sub-byte initializers held as AffineValues
        subbyte = []
        for t in graph.initializer:
            claim(t.name, "dense")
            payload = None
            if t.data_location == TensorProto.EXTERNAL or t.HasField("raw_data"):
                payload = self.model.payload(t)
            self._initializer_protos[t.name] = t
            self.constant_types[t.name] = t.data_type
            if payload is not None:
                self._initializer_payloads[t.name] = payload
            if t.data_type in SUBBYTE:
                subbyte.append((t, payload))
                continue
            self._constants[t.name] = tensor_from_proto(t, payload)
        dq_inputs = {n.input[0] for n in graph.node
                     if n.op_type == "DequantizeLinear" and canonical_domain(n.domain) == ""
                     and n.input}
        # quantization parameters (sub-byte zero points) first, then the values they describe
        for t, payload in sorted(subbyte, key=lambda tp: tp[0].name in dq_inputs):
            self._constants[t.name] = self._subbyte_constant(graph, t, payload)
        for sp in graph.sparse_initializer:
            claim(sp.values.name, "sparse")
            raise ValidationError(
                f"sparse initializer {sp.values.name!r}: sparse tensors are not supported"
            )
        for ev in graph.encoded_initializer:
            claim(ev.name, "encoded")
            self._constants[ev.name] = self._encoded(ev)

    def _subbyte_constant(self, graph, t: TensorProto, payload):
        """An INT4/UINT4/INT2/UINT2 initializer: the zero-copy affine value its DequantizeLinear
        consumers denote when every consumer is one DequantizeLinear form over initializer
        parameters (olv_runtime.structs.recognize), else its values unpacked to int8/uint8."""
        uses = [(n, j) for n in graph.node for j, name in enumerate(n.input) if name == t.name]
        forms = set()
        for n, j in uses:
            if canonical_domain(n.domain) != "" or n.op_type != "DequantizeLinear" or j != 0:
                forms = None
                break
            attrs = {a.name: a.i for a in n.attribute
                     if a.name in ("axis", "block_size", "output_dtype")}
            params = tuple(n.input[1:3]) + ("",) * (3 - len(n.input))
            forms.add((params[0], params[1], attrs.get("axis", 1), attrs.get("block_size", 0),
                       attrs.get("output_dtype", 0)))
        if forms and len(forms) == 1:
            scale_name, zp_name, axis, block, out_dtype = next(iter(forms))
            scale = self._constants.get(scale_name)
            zp = self._constants.get(zp_name) if zp_name else None
            if (isinstance(scale, np.ndarray) and (not zp_name or isinstance(zp, np.ndarray))
                    and payload is not None):
                av = from_dequantize_linear(t.name, t, payload, scale, zp, axis, block,
                                            out_dtype)
                if av is not None:
                    mark_source(av, (t.name, scale_name, zp_name or ""),
                                f"DequantizeLinear axis={axis} block_size={block} "
                                f"output_dtype={out_dtype}")
                    self._recognized.add(t.name)
                    return av
        return param_tensor(t, payload)

    def _encoded(self, ev: EncodedValueProto):
        """The validated AffineValue / StructValue (olv_runtime.decoding.resolve, decoders bound)."""
        return self._encoded_values[ev.name]

    def _plan(self, graph) -> list[Step]:
        nodes = list(graph.node)
        producers: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for o in node.output:
                if not o:
                    continue
                if o in producers or o in self._constants or o in self._input_infos:
                    raise ValidationError(
                        f"value {o!r} is produced more than once (node {node.name or node.op_type!r})"
                    )
                producers[o] = i
        order = self._toposort(nodes, producers)
        impls: dict[int, Any] = {}
        constants = self._constants
        structured_inputs = {name for name, vi in self._input_infos.items()
                             if name not in constants
                             and vi.type.WhichOneof("value") == "struct_type"}
        for i in order:
            node = nodes[i]
            domain = canonical_domain(node.domain)
            if domain not in self._opsets:
                raise UnsupportedOperatorError(
                    f"node {node.name!r} ({node.op_type}) uses domain {node.domain!r}, which the "
                    "model does not import (opset_import)"
                )
            cls = control.resolve(self, domain, node.op_type)  # model-local functions first
            for name in node.input:
                enc = constants.get(name)
                structured = name in structured_inputs
                if structured or (enc is not None and isinstance(enc, (AffineValue, StructValue))):
                    what = "an encoded value" if enc is not None else "a structured graph input"
                    recognized = (name in self._recognized and domain == ""
                                  and node.op_type == "DequantizeLinear")
                    if (domain, node.op_type) not in ENCODED_CONSUMERS and not recognized and not (
                            structured and getattr(cls, "accepts_structured", False)):
                        raise MissingDecoderError(
                            f"node {node.name!r} ({node.op_type}) is a tensor-only operator but "
                            f"input {name!r} is {what}; decode it explicitly with "
                            "olv.Decode (seed 000: no implicit decoding)"
                        )
                    if isinstance(enc, StructValue) and enc.decoder is None:
                        raise MissingDecoderError(
                            f"node {node.name!r} ({node.op_type}): {enc.describe()}: "
                            f"{enc.decoder_error}"
                        )
            _check_output_count(node, domain, self._opsets[domain])
            impls[i] = cls(node, self)
        consumers: dict[str, list[tuple[int, int]]] = {}
        for i in order:
            for j, name in enumerate(nodes[i].input):
                if name:
                    consumers.setdefault(name, []).append((i, j))
        graph_outputs = set(self._output_names)
        fused: dict[int, Step] = {}
        dead: set[int] = set()
        if self.options.enable_fusion:
            fused, dead = self._fuse(nodes, order, producers, consumers, graph_outputs, impls)
        steps: list[Step] = []
        for i in order:
            if i in dead:
                continue
            node = nodes[i]
            if i in fused:
                steps.append(fused[i])
                continue
            impl = impls[i]
            steps.append(Step(impl.name, node.op_type, impl.run,  # If: + outer-scope inputs
                              getattr(impl, "step_inputs", node.input), node.output, impl))
        for name in graph_outputs:
            if name not in producers and name not in self._constants and name not in self._input_infos:
                raise ValidationError(f"graph output {name!r} is not produced by any node")
        if self.options.enable_fusion:
            steps = optimize(steps, self._constants, graph_outputs, self.options, self.counters,
                             self.compiled)
        else:
            prepare_linears(steps, self.counters, self.compiled)
        self._set_lifetimes(steps, graph_outputs)
        return steps

    def _toposort(self, nodes, producers) -> list[int]:
        available = set(self._constants) | set(self._input_infos) | {""}
        indeg = []
        waiting: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            missing = {n for n in node.input if n not in available}
            for n in missing:
                if n not in producers:
                    raise ValidationError(
                        f"node {node.name or node.op_type!r} input {n!r} is not a graph input, "
                        "initializer or node output"
                    )
                waiting.setdefault(n, []).append(i)
            indeg.append(len(missing))
        ready = [i for i, d in enumerate(indeg) if d == 0]
        order = []
        while ready:
            i = ready.pop(0)
            order.append(i)
            for o in nodes[i].output:
                for j in waiting.pop(o, []):
                    indeg[j] -= 1
                    if indeg[j] == 0:
                        ready.append(j)
            ready.sort()
        if len(order) != len(nodes):
            stuck = [nodes[i].name or nodes[i].op_type for i in range(len(nodes)) if i not in set(order)]
            raise ValidationError(f"the graph has a cycle through nodes {stuck[:5]}")
        return order

    def _fuse(self, nodes, order, producers, consumers, graph_outputs, impls=None):
        """Pattern fusion; returns (fused steps by node index, dead node indices)."""
        fused: dict[int, Step] = {}
        removable: dict[int, set[tuple[int, int]]] = {}  # producer node → fused consumer uses

        def const_source(name: str, form: str = "nk"):
            """(weight object, chain of node indices) for Decode(enc), a recognised
            DequantizeLinear over initializers, or a dense constant. ``form``: "nk" (a linear
            weight [N, K]), "kn" (a MatMul B [K, N]) or "gather" (an embedding table)."""
            c = self._constants.get(name)
            if isinstance(c, np.ndarray):
                return (c, []) if form != "kn" else (None, [])
            p = producers.get(name)
            if p is None:
                return None, []
            node = nodes[p]
            kind = (canonical_domain(node.domain), node.op_type)
            src = self._constants.get(node.input[0]) if node.input else None
            if isinstance(src, AffineValue) and (kind == ("olv", "Decode") or (
                    kind == ("", "DequantizeLinear") and node.input[0] in self._recognized)):
                w = (gather_table(src, self.counters) if form == "gather"
                     else affine_linear_weight(src, form == "kn", self.counters))
                if w is not None:
                    return w, [p]
                return None, []
            if form == "kn":
                return None, []
            if kind == ("olv", "Decode"):
                if isinstance(src, StructValue) and self.options.prepack:
                    # ggml blocks (GGUF imports): a native consumer verified against the
                    # declaration repacks them for the packed INT4 kernels
                    rep = linear_weight(src, self.counters)
                    if rep is not None:
                        return rep, [p]
            return None, []

        for i in order:
            node = nodes[i]
            dom = canonical_domain(node.domain)
            if dom == "com.microsoft" and node.op_type == "MatMulNBits" and impls is not None:
                impl = impls[i]
                weight = affine_linear_weight(impl.weight, False, self.counters)
                if weight is None:  # 8-bit: the op decodes once and multiplies in float32
                    continue
                name = node.name or f"MatMulNBits({node.output[0]})"
                lin = LinearStep(name, [weight], self.options, self.counters)
                if impl.bias is not None:
                    lin.biases[0] = np.ascontiguousarray(impl.bias, np.float32)
                fused[i] = Step(name, "Linear", lin, [node.input[0]], node.output, lin)
                continue
            if dom == "" and node.op_type == "MatMul" and len(node.input) == 2:
                t_idx = producers.get(node.input[1])
                if t_idx is None:
                    continue
                t = nodes[t_idx]
                if (canonical_domain(t.domain), t.op_type) == ("", "DequantizeLinear"):
                    # QDQ: MatMul(x, DequantizeLinear(B [K, N])) on the INT4 kernels
                    weight, chain = const_source(node.input[1], "kn")
                    if weight is None:
                        continue
                    name = node.name or f"MatMul({node.output[0]})"
                    lin = LinearStep(name, [weight], self.options, self.counters)
                    fused[i] = Step(name, "Linear", lin, [node.input[0]], node.output, lin)
                    removable.setdefault(t_idx, set()).add((i, 1))
                    continue
                if canonical_domain(t.domain) != "" or t.op_type != "Transpose":
                    continue
                perm = [list(a.ints) for a in t.attribute if a.name == "perm"]
                if perm and perm[0] != [1, 0]:
                    continue
                weight, chain = const_source(t.input[0])
                if weight is None:
                    continue
                if isinstance(weight, np.ndarray) and (weight.ndim != 2 or weight.dtype != np.float32):
                    continue
                name = node.name or f"MatMul({node.output[0]})"
                lin = LinearStep(name, [weight], self.options, self.counters)
                fused[i] = Step(name, "Linear", lin, [node.input[0]], node.output, lin)
                removable.setdefault(t_idx, set()).add((i, 1))
                for p in chain:  # the Decode dies only if the Transpose does
                    removable.setdefault(p, set())
            elif dom == "" and node.op_type == "Gather" and len(node.input) == 2:
                axis = [a.i for a in node.attribute if a.name == "axis"]
                if axis and axis[0] != 0:
                    continue
                weight, chain = const_source(node.input[0], "gather")
                if not isinstance(weight, (AffineValue, GGMLWeight)):
                    continue
                name = node.name or f"Gather({node.output[0]})"
                gat = (GGMLGather(name, weight) if isinstance(weight, GGMLWeight)
                       else EncodedGather(name, weight))
                fused[i] = Step(name, "EncodedGather", gat, [node.input[1]], node.output, gat)
                for p in chain:
                    removable.setdefault(p, set()).add((i, 0))
        # A producer is dead when every use of every output is a fused use (iterate: a Decode
        # feeding only dead Transposes becomes dead too).
        dead: set[int] = set()
        changed = True
        while changed:
            changed = False
            for p, uses in removable.items():
                if p in dead:
                    continue
                outs = [o for o in nodes[p].output if o]
                if any(o in graph_outputs for o in outs):
                    continue
                all_uses = {u for o in outs for u in consumers.get(o, [])}
                live_uses = {u for u in all_uses if u[0] not in dead} - uses
                if not live_uses:
                    dead.add(p)
                    changed = True
        return fused, dead

    def _set_lifetimes(self, steps: list[Step], graph_outputs: set[str]) -> None:
        last: dict[str, int] = {}
        for idx, step in enumerate(steps):
            for n in step.inputs:
                if n:
                    last[n] = idx
            for n in step.outputs:
                if n:
                    last.setdefault(n, idx)
        # graph inputs are never this run's pool buffers (the caller holds them): not released
        keep = graph_outputs | set(self._constants) | set(self._input_infos)
        per_step: list[list[str]] = [[] for _ in steps]
        for name, idx in last.items():
            if name not in keep:
                per_step[idx].append(name)
        for step, rel in zip(steps, per_step):
            step.release = tuple(rel)

    def _strided_inputs(self, graph) -> frozenset:
        """Graph inputs read only as Attention past_key/past_value (or by Shape/Size): they may be
        strided views (e.g. a previous call's present, a prefix of a KV capacity buffer)."""
        infos = self._input_infos
        uses: dict[str, set] = {}
        for node in graph.node:
            op = None
            for j, name in enumerate(node.input):
                if name in infos:  # only graph inputs matter (most inputs are node outputs)
                    op = op or node.op_type
                    any_strides = (op == "Attention" and j in (4, 5)) or \
                        (op == "GroupQueryAttention" and j in (3, 4)) or op in ("Shape", "Size")
                    uses.setdefault(name, set()).add("past" if any_strides else "other")
        outs = set(self._output_names)
        return frozenset(n for n, u in uses.items() if u == {"past"} and n not in outs)

    # -- public read-only views (what the state, the operators and the layers above read) ----
    @property
    def opsets(self) -> Mapping[str, int]:
        """The model's opset imports, ``{canonical domain: version}`` (``""`` is ai.onnx;
        read-only)."""
        return self._opsets_view

    @property
    def input_infos(self) -> Mapping[str, ValueInfoProto]:
        """Every graph input's ValueInfoProto by name, constant-backed ones included
        (read-only)."""
        return self._input_infos_view

    @property
    def constant_names(self) -> frozenset:
        """Names of the graph's initializers (dense and encoded) as the plan sees them."""
        return frozenset(self._constants)

    @property
    def output_names(self) -> tuple:
        """The graph outputs' names, in graph order."""
        return self._output_names_t

    @property
    def symbolic_groups(self) -> tuple:
        """One tuple of ``(input name, axis)`` pairs per ``dim_param`` that two or more inputs
        share (their sizes must agree in a call)."""
        return self._symbolic_groups_t

    def accepts_strided(self, name: str) -> bool:
        """True if input ``name`` may be fed as a non-contiguous view (KV past inputs)."""
        return name in self._strided_ok

    # -- introspection -------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        """Graph inputs that are not initializers (what ``run`` needs)."""
        return [NodeArg(vi.name, type_string(vi), declared_shape(vi)) for vi in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        """Graph outputs."""
        return [NodeArg(vi.name, type_string(vi), declared_shape(vi)) for vi in self._outputs]

    def get_modelmeta(self) -> dict[str, str]:
        """``metadata_props`` of the model."""
        return self.model.metadata()

    def compiled_report(self) -> list:
        """Use of each seed 004 compiled entry of the model by this session: a list of
        :class:`olv_runtime.structs.compiled.EntryStatus` (``status`` "hit", "miss" with its ``reason``,
        or "unused"); empty when the model has none or ``use_compiled`` is False."""
        return self.compiled.report() if self.compiled is not None else []

    def all_steps(self) -> list:
        """Every step of the plan, the steps inside composite steps (a ``DecoderStack``'s
        per-operator steps, which it runs for calls its compiled path does not take) included,
        after their composite step."""
        out = []
        for s in self._steps:
            out.append(s)
            out.extend(getattr(s.impl, "sub_steps", ()))
        return out

    def plan(self) -> list[tuple[str, str]]:
        """The execution plan as (kind, name) pairs — fused steps show as Linear/EncodedGather."""
        return [(s.kind, s.name) for s in self._steps]

    # -- execution -----------------------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any], run_options=None) -> list:
        """Run the graph.

        Parameters
        ----------
        output_names : list of str or None
            Outputs to return, in order (None: all graph outputs).
        feeds : dict
            Input name → numpy array or DLPack-capable CPU tensor (e.g. torch). Arrays enter
            without copies; they must be C-contiguous, native byte order, and of the declared
            element type and rank.

        Returns
        -------
        list of numpy.ndarray

        Raises
        ------
        InvalidArgument
            Unknown or missing feed, wrong dtype/rank/fixed dim, unsupported memory layout,
            unknown output name.
        """
        names = list(self._output_names) if output_names is None else list(output_names)
        for n in names:
            if n not in self._output_names:
                raise InvalidArgument(
                    f"unknown output {n!r}; the graph outputs are {self._output_names}"
                )
        env = self.run_env(self.prepare_feeds(feeds))
        return [env[n] for n in names]

    def prepare_feeds(self, feeds: Mapping[str, Any],
                      trusted: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Validate feeds (names, dtypes, ranks, layouts) and view them as numpy arrays.

        ``trusted``: values of inputs already validated against this session's input specs
        (a :class:`~olv_runtime.state.State`'s retained values, checked when they were
        retained); they enter as they are, without a second per-value check. The symbolic
        dimension check runs over all values."""
        if not isinstance(feeds, Mapping):
            raise InvalidArgument(f"feeds must be a dict of name -> array, got {type(feeds).__name__}")
        out: dict[str, np.ndarray] = dict(trusted) if trusted else {}
        for name, value in feeds.items():
            vi = self._input_infos.get(name)
            if vi is None:
                raise InvalidArgument(
                    f"unknown input {name!r}; the graph inputs are {[v.name for v in self._inputs]}"
                )
            if self._specs[name].kind == "struct_type":  # a whole struct value (RuntimeStruct)
                out[name] = self.check_struct(name, value)
                continue
            out[name] = check_tensor(name, value, self._specs[name],
                                     allow_strided=name in self._strided_ok)
        if not self._input_name_set.issubset(out):
            for vi in self._inputs:
                if vi.name not in out:
                    raise InvalidArgument(f"missing input {vi.name!r} ({type_string(vi)}, shape {declared_shape(vi)})")
        self.check_symbolic_dims(out)
        return out

    def check_symbolic_dims(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Check that inputs sharing a symbolic dimension (``dim_param``) agree on its size.

        ONNX IR: within a graph, one dim_param name denotes one size. For a model with past KV
        inputs ``past_key.i`` ``[batch, KVH, past_sequence, D]`` this makes every layer's past
        length the same (a cache whose layers disagree would run and give wrong presents).

        Raises
        ------
        InvalidArgument
            Naming the dim_param and the two inputs with their sizes.
        """
        try:  # the common case: every value present, one size per dim_param
            for pairs in self._symbolic_groups:
                if len({arrays[n].shape[a] for n, a in pairs}) != 1:
                    break
            else:
                return
        except (KeyError, AttributeError, IndexError, TypeError):
            pass  # missing or other values: the check below skips them as it always did
        seen: dict[str, tuple[str, int]] = {}
        for name, axis, param in self._symbolic_dims:
            arr = arrays.get(name)
            if arr is None or not isinstance(arr, np.ndarray) or arr.ndim <= axis:
                continue
            size = arr.shape[axis]
            first = seen.setdefault(param, (name, size))
            if first[1] != size:
                raise InvalidArgument(
                    f"inputs {first[0]!r} and {name!r} disagree on dimension {param!r}: "
                    f"{first[1]} vs {size} (one dim_param is one size across the graph's "
                    f"inputs; e.g. every layer's past length must be the same)"
                )

    def check_struct(self, name: str, value: Any):
        """Validate a whole struct value fed to struct-typed input ``name`` (no copy; memoised per
        value, see :func:`olv_runtime.structs.runtime.check_struct_value`)."""
        return check_struct_value(f"input {name}", value,
                                  self._input_infos[name].type.struct_type,
                                  resolve_encoded(self.model).catalogue)

    def buffer_pool(self) -> BufferPool:
        """This thread's activation buffer pool for this session (see :mod:`olv_runtime.pool`)."""
        pool = getattr(self._pools, "pool", None)
        if pool is None:
            pool = self._pools.pool = BufferPool(self.counters)
        return pool

    def recycle(self, array) -> bool:
        """Hand a returned output array back for reuse (the caller must not use it again).

        Returns True when ``array`` was an output buffer of this thread's pool (taken back),
        False otherwise (ignored). ``generate`` recycles the logits so decode allocates nothing.
        """
        return self.buffer_pool().recycle(array)

    def rows_program(self):
        """``(RowsProgram, "")`` when the plan can run rows of many sequences over a block pool
        (:mod:`olv_runtime.executor.rows`, the batching engine's forward), else ``(None, reason)``;
        made once per session."""
        d = self.__dict__
        if "_rows" not in d:
            d["_rows"] = rows_program(self)
        return d["_rows"]

    def decode_program(self) -> "DecodeProgram | None":
        """The plan's :class:`DecodeProgram` (None when the plan is not of its form)."""
        d = self.__dict__
        if "_program" not in d:
            d["_program"] = DecodeProgram.build(self)
        return d["_program"]

    def _slot_plan(self) -> "_SlotPlan":
        plan = self.__dict__.get("_slots")
        if plan is None:
            plan = self._slots = _SlotPlan(self._steps, self._constants, self._input_infos,
                                           self._output_names)
        return plan

    def run_env(self, feeds: dict[str, Any], last_only: frozenset = frozenset(),
                appended: list | None = None) -> dict[str, Any]:
        """Execute the plan on prepared feeds; returns the graph outputs by name.

        ``last_only``: graph output names needed at the last position only (axis -2, e.g. the
        logits of a prefill, of which :func:`~olv_runtime.generate` reads one row). When such an
        output is produced directly by a row-wise linear step (a fused Decode/MatMul:
        ``y[..., s, :]`` depends only on ``x[..., s, :]``), the step runs on the last row of
        its input and the output has size 1 on axis -2; other outputs are computed in full.

        ``appended``: a list that receives, per step that appended to its KV inputs in place
        (:class:`~olv_runtime.executor.steps.KVAppended`), the tuple of ``(output, input)`` name pairs
        of those values (one tuple object per step, the same at every run; a
        :class:`~olv_runtime.state.State` retains such outputs without a second check).

        The values live in a list indexed by slots fixed when the plan was made
        (:class:`_SlotPlan`): a run copies one list of the constants the steps read, not a
        dict of every initializer.
        """
        self.model.check_external_files()  # PayloadError if a mapped file changed (no SIGBUS)
        plan = self._slots if "_slots" in self.__dict__ else self._slot_plan()
        vals = plan.template.copy()
        slot = plan.slot
        for n, v in feeds.items():
            i = slot.get(n)
            if i is not None:
                vals[i] = v
        counters = self.counters
        counters.add("runs", 1)
        if self.options.num_threads is not None:
            # numba's thread count is per calling thread: apply this session's on every run
            kernels.config.thread_count_fns()[0](int(self.options.num_threads))
        pool = self._pools.pool if hasattr(self._pools, "pool") else self.buffer_pool()
        meter = counters.run_meter(pool, committed_length)  # arrays allocated, workspace peak
        prev = pool_mod.activate(pool)
        token = LAST_ONLY.set(frozenset(last_only)) if last_only else None
        if token is None and LAST_ONLY.get():
            token = LAST_ONLY.set(frozenset())
        ok = False
        kv_slots = None  # slots of values that are KV views (KVResults): no pool buffers
        try:
            for step, ins, outs, rel in plan.steps:
                args = [vals[i] for i in ins]
                if last_only:
                    args = last_position_args(step, args, last_only)
                try:
                    results = step.fn(*args)
                except (InvalidArgument, ValidationError):
                    raise
                except Exception as exc:
                    raise node_failed(step, exc) from exc
                tr = type(results)
                if tr is KVResults or tr is KVAppended:
                    k = results.pooled
                    tail = outs[k:]
                    for i, v in zip(tail, results[k:]):
                        if i >= 0:
                            vals[i] = v
                    kv_slots = set(tail) if kv_slots is None else kv_slots | set(tail)
                    if tr is KVAppended and appended is not None:
                        appended.append(plan.kv_pairs(step, k))
                    outs, results = outs[:k], results[:k]
                for i, v in zip(outs, results):
                    if i >= 0:
                        vals[i] = v
                        pool.ref(v)
                meter.step(args, results)
                for i in rel:
                    v = vals[i]
                    vals[i] = None
                    pool.unref(v)
            outputs = {n: vals[i] for n, i in plan.outputs}
            if kv_slots:
                pool.escape([vals[i] for _, i in plan.outputs if i not in kv_slots])
            else:
                pool.escape(outputs.values())
            pool.end_run()
            ok = True
        finally:
            if token is not None:
                LAST_ONLY.reset(token)
            pool_mod.restore(prev)
            if not ok:
                pool.abort_run()
        meter.finish()
        return outputs


_I64 = np.dtype(np.int64)


@functools.lru_cache(maxsize=None)
def _schema_outputs(op_type: str, version: int, domain: str) -> tuple[int, int] | None:
    if domain == "":
        if op_type in OUTPUTS:  # onnx.defs' figures without importing it (warm start)
            return output_range(op_type, int(version))
    import onnx.defs

    try:
        schema = onnx.defs.get_schema(op_type, int(version), domain)
    except Exception:  # no schema (other domains, unknown op): the op class decides
        return None
    return schema.min_output, schema.max_output


def _check_output_count(node, domain: str, version: int) -> None:
    """A standard node declares no more outputs than its ONNX schema allows (ValidationError).

    Source: the operator schemas of ``onnx.defs`` (min_output / max_output), tabulated in
    :mod:`olv_runtime.ops.schema_outputs`."""
    if domain != "" or not 0 < int(version) < 1 << 31:
        return
    got = _schema_outputs(node.op_type, int(version), "")
    if got is None:
        return
    lo, hi = got
    n = len(node.output)
    if not lo <= n <= hi:
        raise ValidationError(
            f"node {node.name or node.op_type!r} ({node.op_type}): declares {n} outputs "
            f"({list(node.output)}); the ONNX schema allows {lo} to {hi}"
        )
