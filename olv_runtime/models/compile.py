"""``olv compile``: write a model with persisted prepacked weights (seed 004
``CompiledTensorProto`` entries for this CPU, :func:`compile_model`).

The format, its validation and the loading side the session uses are in
:mod:`olv_runtime.structs.compiled`; this module builds a session to prepack every linear weight
the way it would run, then writes the entries, their payload file and the model.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import warnings

import numpy as np

from olv_runtime.errors import CompiledTensorError, OutputError, SidecarError
from olv_runtime.executor.session import InferenceSession, SessionOptions
from olv_runtime.executor.steps import LinearStep
from olv_runtime.io import (
    Model,
    as_model,
    commit_staged,
    discard_staged,
    load,
    same_file,
    stage_save,
)
from olv_runtime.io.sidecars import SIDECAR_FILES, check_replacements, sidecar_path
from olv_runtime.kernels.arena import HUGE_PAGE
from olv_runtime.kernels.layouts import layout_of
from olv_runtime.models.hf import check_output_path
from olv_runtime.proto import (
    CompiledTensorProto,
    DeviceProto,
    ModelProto,
    StructTypeProto,
    TensorProto,
)
from olv_runtime.structs.build import const_field, field, structure, tensor
from olv_runtime.structs.compiled import (
    _ALIGN,
    DEFAULT_DIGEST_ALGORITHM,
    PAYLOAD_DIGEST_KEY,
    _device_key,
    _find_initializer,
    _hash_parts,
    payload_parts,
    canonical_parts,
    source_name_of,
    this_device,
)
from olv_runtime.structs.initializers import DTYPE_TO_ONNX


class _HugePageWriter:
    """A file writer that issues only whole 2 MiB writes at 2 MiB-aligned offsets (and the tail
    at close): the page cache then holds the written file in 2 MiB folios, which a session maps
    with 2 MiB pages (fewer TLB misses and page-boundary stops in the per-token weight stream;
    see :mod:`olv_runtime.kernels.arena`). Measured here: a file written in 2 MiB pieces was
    mapped with 2 MiB pages throughout, one written in 1 MiB pieces with none."""

    def __init__(self, raw):
        self._raw = raw
        self._size = HUGE_PAGE
        self._buf = bytearray()

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        self._buf += mv
        if len(self._buf) >= self._size:
            whole = len(self._buf) // self._size * self._size
            view = memoryview(self._buf)
            pos = 0
            while pos < whole:
                pos += self._raw.write(view[pos:whole])
            view.release()
            del self._buf[:whole]
        return n

    def close(self) -> None:
        try:
            view = memoryview(self._buf)
            pos = 0
            while pos < len(view):
                pos += self._raw.write(view[pos:])
            view.release()
        finally:
            self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class CompileWarning(UserWarning):
    """``olv compile`` wrote its output but dropped something or replaced a file (the message
    says what and why)."""


@dataclasses.dataclass
class CompileReport:
    """What :func:`compile_model` wrote.

    ``carried``: other devices' entries whose payload bytes were copied into the new payload
    file; ``dropped``: ``(source_name, device, reason)`` of other devices' entries left out (their
    payload could not be read); ``sidecars``: sidecar files copied beside the output."""

    path: pathlib.Path
    compiled_path: pathlib.Path
    entries: int
    bytes: int
    device: str
    skipped: list
    carried: int = 0
    dropped: list = dataclasses.field(default_factory=list)
    sidecars: list = dataclasses.field(default_factory=list)


_ROLE_TEXT = {"model": "the model file", "data": "an external data file",
              "compiled": "the compiled payload file"}
_OUT_TEXT = {"model": "model file", "data": "data file", "compiled": "payload file",
             "sidecar": "sidecar"}


def _external_locations(graph) -> set:
    """``location`` of every external payload in a graph (initializers, encoded values and their
    scales / zero points, sparse values, attributes and subgraphs)."""
    locs, stack = set(), [graph]
    while stack:
        msg = stack.pop()
        for fd, value in msg.ListFields():
            if fd.name == "external_data":
                locs.update(e.value for e in value if e.key == "location")
            elif fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
                if fd.is_repeated:
                    stack.extend(value)
                else:
                    stack.append(value)
    return locs


def _input_files(m: Model) -> list:
    """``(role, resolved path)`` of every file ``m`` reads: ``model``, ``data`` (external data,
    also any file already mapped) and ``compiled`` (payload files of its compiled entries)."""
    if m.path is None:
        return []
    files = [("model", m.path)]
    base = m.base_dir

    def add(role, loc):
        try:
            files.append((role, (base / pathlib.PurePosixPath(loc.replace("\\", "/"))).resolve()))
        except (OSError, RuntimeError, ValueError):
            pass

    for loc in sorted(_external_locations(m.proto.graph)):
        add("data", loc)
    for e in m.proto.compiled_tensors:
        if e.value.data_location == TensorProto.EXTERNAL:
            loc = {x.key: x.value for x in e.value.external_data}.get("location")
            if loc:
                add("compiled", loc)
    files += [("data", p) for p in m._maps]
    files += [("compiled", p) for p in getattr(m, "_compiled_maps", {})]
    seen, out = set(), []
    for f in files:
        if f not in seen:
            seen.add(f)
            out.append(f)
    return out


def _check_outputs(m: Model, out: pathlib.Path, keep_external: bool) -> None:
    """Refuse, before any work, an output whose model, ``.data``, ``.compiled`` or sidecar
    file would be a file the input model reads (resolved path or same inode), unless it is the
    same file in the same role of an in-place compile (atomically replaced: the input is
    replaced as a whole); and outputs that cannot be written (directories)."""
    check_output_path(out, (), "output")
    targets = [("model", out), ("data", out.with_name(out.name + ".data")),
               ("compiled", out.with_name(out.name + ".compiled"))]
    for _role, t in targets[1:]:
        if t.is_dir():
            raise OutputError(f"cannot write {str(t)!r} (written with the output model "
                              f"{str(out)!r}): it is an existing directory")
    targets += [("sidecar", out.parent / n) for n in SIDECAR_FILES]
    inplace = m.path is not None and same_file(out, m.path)
    inputs = _input_files(m)
    for role_t, t in targets:
        for role_f, f in inputs:
            if not same_file(t, f):
                continue
            if inplace and role_t == role_f and not (role_t == "data" and keep_external):
                continue  # replaced atomically, with the input model that reads it
            raise OutputError(
                f"the output's {_OUT_TEXT[role_t]} {str(t)!r} would overwrite {_ROLE_TEXT[role_f]} "
                f"{str(f)!r} of the input model {str(m.path)!r}: refusing, nothing was written "
                "(choose another output path)")


def _plan_sidecars(m: Model, out: pathlib.Path, warn) -> dict:
    """The input model's own sidecars (tokenizer.json, ...) to copy beside ``out``: name ->
    bytes. Files already there with the same bytes (or the same file) are not copied; a
    different file another model in that folder records is refused (as ``olv convert`` does);
    any other different file is replaced with a warning."""
    if m.path is None:
        return {}
    files, replaced = {}, []
    for name in SIDECAR_FILES:
        try:
            src = sidecar_path(m, name)
        except SidecarError as exc:
            warn(f"sidecar {name} not copied: {exc}")
            continue
        if src is None:
            continue
        dst = out.parent / name
        if same_file(dst, src):
            continue
        data = src.read_bytes()
        if dst.exists() or dst.is_symlink():
            if not dst.is_file():
                raise OutputError(f"cannot write sidecar {str(dst)!r}: it exists and is not a "
                                  "regular file")
            if dst.read_bytes() == data:
                continue
            replaced.append(name)
        files[name] = data
    if replaced:
        check_replacements(out, {n: files[n] for n in replaced})
        warn(f"replaced {', '.join(replaced)} in {str(out.parent)!r} with the input model's "
             f"(they differed; no other model in that folder records them)")
    return files


def _kept_range(m: Model, v) -> tuple | str:
    """``(file, offset, length)`` of another device's external compiled payload, or the reason
    it cannot be carried into the new payload file."""
    ext = {x.key: x.value for x in v.external_data}
    location = ext.get("location", "")
    try:
        offset, length = int(ext.get("offset", "0")), int(ext["length"])
    except (KeyError, ValueError):
        return "its payload has no valid offset / length"
    if m.base_dir is None:
        return "the input model was not loaded from a file (no directory for its payload file)"
    rel = pathlib.PurePosixPath(location.replace("\\", "/"))
    try:
        full = (m.base_dir / rel).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"payload location {location!r} cannot be resolved: {exc}"
    if rel.is_absolute() or m.base_dir not in full.parents:
        return f"payload location {location!r} is not inside the model directory"
    if offset < 0 or length <= 0:
        return f"payload range offset {offset} length {length} is invalid"
    if not full.is_file():
        return f"payload file {location!r} not found"
    return full, offset, length


def _carry_kept(m: Model, kept: list, fh, offset: int, cname: str, devices) -> tuple:
    """Copy the external payloads of other devices' entries ``kept`` into ``fh`` (the new
    payload file, at ``offset``) and point the entries at it. Overlapping or touching byte
    ranges of one file (the records of a merged weight share bytes) are copied once, as one
    piece at the same offset modulo the alignment: the records keep their relative layout.
    Regular reads, never the model's mappings. Returns ``(entries carried, dropped, new
    offset)``; ``dropped``: ``(source_name, device, reason)``."""
    carried, dropped, spans = [], [], {}
    for e2 in kept:
        v = e2.value
        if v.data_location != TensorProto.EXTERNAL:
            carried.append(e2)
            continue
        got = _kept_range(m, v)
        if isinstance(got, str):
            d = devices[e2.device]
            dropped.append((e2.source_name, f"{d.type}:{d.architecture}", got))
            continue
        spans.setdefault(got[0], []).append((got[1], got[2], e2))
    for full, items in spans.items():
        items.sort(key=lambda t: t[0])
        groups, cur = [], None
        for off, n, e2 in items:
            if cur is not None and off <= cur[1]:
                cur[1] = max(cur[1], off + n)
                cur[2].append((off, n, e2))
            else:
                cur = [off, off + n, [(off, n, e2)]]
                groups.append(cur)
        try:
            fsrc = open(full, "rb")
        except OSError as exc:
            for _o, _n, e2 in items:
                d = devices[e2.device]
                dropped.append((e2.source_name, f"{d.type}:{d.architecture}",
                                f"payload file {full.name!r} cannot be read "
                                f"({exc.strerror or exc})"))
            continue
        with fsrc:
            for g0, g1, members in groups:
                fsrc.seek(g0)
                data = fsrc.read(g1 - g0)
                ok = [(o, n, e2) for o, n, e2 in members if o + n <= g0 + len(data)]
                for o, n, e2 in members:
                    if o + n > g0 + len(data):
                        d = devices[e2.device]
                        dropped.append((e2.source_name, f"{d.type}:{d.architecture}",
                                        f"payload [{o}, {o + n}) lies past the end of "
                                        f"{full.name!r} (truncated)"))
                if not ok:
                    continue
                p = (g0 - offset) % _ALIGN
                if p:
                    fh.write(b"\0" * p)
                    offset += p
                fh.write(data)
                for o, n, e2 in ok:
                    v = e2.value
                    del v.external_data[:]
                    v.external_data.add(key="location", value=cname)
                    v.external_data.add(key="offset", value=str(offset + o - g0))
                    v.external_data.add(key="length", value=str(n))
                    carried.append(e2)
                offset += len(data)
    order = {id(e2): i for i, e2 in enumerate(kept)}
    carried.sort(key=lambda e2: order[id(e2)])
    return carried, dropped, offset


def _entry_type(lay, arrays: list, gaps: list, ints: dict) -> StructTypeProto:
    fields = []
    for j, (name, arr) in enumerate(arrays):
        if gaps[j]:
            fields.append(field(f"gap{j}", tensor(TensorProto.UINT8, [gaps[j]])))
        fields.append(field(name, tensor(DTYPE_TO_ONNX[arr.dtype.newbyteorder("=")],
                                         list(arr.shape))))
    for name, v in ints.items():
        fields.append(const_field(name, np.array(v, np.int64)))
    st = structure(*fields)
    st.name = lay.name
    st.doc_string = ("olv_runtime prepacked weight (kernels/layouts.py); runtime-specific, no "
                     "decoder: the source initializer is the portable form")
    return st


class _PayloadFile:
    """The payload file being written: its current offset, alignment padding, array bytes."""

    def __init__(self, fh):
        self.fh = fh
        self.offset = 0

    def pad_to(self, align: int) -> None:
        p = (-self.offset) % align
        if p:
            self.fh.write(b"\0" * p)
            self.offset += p

    def write(self, part: np.ndarray) -> None:
        b = part.reshape(-1).view(np.uint8) if part.size else b""
        self.fh.write(memoryview(b) if part.size else b"")
        self.offset += part.nbytes


def _other_devices(m: Model, here: DeviceProto) -> tuple:
    """A copy of the model's proto keeping other devices' entries' devices (this device added
    last) and no compiled tensors; the kept entries (device indices remapped) and this
    device's index."""
    proto = ModelProto()
    proto.CopyFrom(m.proto)
    old_devices = list(proto.devices)
    keep = [e for e in proto.compiled_tensors
            if _device_key(old_devices[e.device]) != _device_key(here)]
    devices = [d for d in old_devices if _device_key(d) != _device_key(here)]
    remap = {_device_key(d): i for i, d in enumerate(devices)}
    del proto.devices[:]
    proto.devices.extend(devices)
    kept = []
    for e in keep:
        e2 = CompiledTensorProto()
        e2.CopyFrom(e)
        e2.device = remap[_device_key(old_devices[e.device])]
        kept.append(e2)
    dev_index = len(devices)
    proto.devices.add().CopyFrom(here)
    del proto.compiled_tensors[:]
    return proto, kept, dev_index


def _compile_step(m: Model, step, pw: _PayloadFile, used_sources: set, skipped: list,
                  dev_index: int, cname: str) -> list:
    """The compiled entries of one plan step's packed weights, their bytes written to ``pw``;
    [] (with the reason appended to ``skipped`` where there is one) for a step that has none."""
    lin = step.impl
    if not isinstance(lin, LinearStep):
        if step.kind.endswith("Linear"):
            skipped.append((step.name, f"{step.kind} weights are repacked at session "
                                       "creation and have no persisted layout"))
        return []
    if lin.packed is None:
        return []
    lay = layout_of(lin.packed)
    if lay is None:
        skipped.append((step.name, f"packed class {type(lin.packed).__name__} has "
                                   "no persisted layout"))
        return []
    ws = lin.weights
    if any(w.shape[0] % lay.rows_per_group for w in ws[:-1]):
        skipped.append((step.name, f"merged rows not multiples of "
                                   f"{lay.rows_per_group}"))
        return []
    snames = [source_name_of(w) for w in ws]
    bad = [n for n in snames if n in used_sources
           or len(_find_initializer(m.proto, n)) != 1]
    if bad:
        skipped.append((step.name, f"source {bad[0]!r} is not exactly one "
                                   "initializer of the root graph, or is the source "
                                   "of another compiled weight"))
        return []
    try:
        sdigests = [_hash_parts(canonical_parts(m, sn, w), DEFAULT_DIGEST_ALGORITHM)[0]
                    for sn, w in zip(snames, ws)]
    except CompiledTensorError as exc:
        skipped.append((step.name, str(exc)))
        return []
    used_sources.update(snames)
    arrays, _ints = lay.parts(lin.packed)
    if (arrays.get("scale") is not None and arrays["scale"].dtype == np.uint16
            and all(np.asarray(w.scale).dtype == np.float32 for w in ws)):
        # float32 scales the session stored as float16 (all exact, see
        # executor.stack_linears.narrow_scales): persisted as the source's float32 values
        arrays["scale"] = arrays["scale"].view(np.float16).astype(np.float32)
    # per-weight parts: slices along the row-group axis
    bounds, g0 = [], 0
    for w in ws:
        g1 = g0 + -(-w.shape[0] // lay.rows_per_group)
        bounds.append((g0, g1))
        g0 = g1
    starts = {}  # (array, weight index) -> file offset
    for name in lay.arrays:
        a = arrays[name]
        pw.pad_to(_ALIGN)
        for j, (a0, a1) in enumerate(bounds):
            part = np.ascontiguousarray(a[a0:a1]) if a.shape[0] else a
            starts[(name, j)] = (pw.offset, part)
            pw.write(part)
    entries = []
    for j, w in enumerate(ws):
        fields, gaps, pos, hashed = [], [], None, []
        for name in lay.arrays:
            o, part = starts[(name, j)]
            if pos is None:
                first, pos = o, o
            gaps.append(o - pos)
            fields.append((name, part))
            hashed.append(part)
            pos = o + part.nbytes
        length = pos - first
        st = _entry_type(lay, fields, gaps, {"n": w.shape[0], "k": w.shape[1]})
        e = CompiledTensorProto(source_name=snames[j], device=dev_index,
                                digest_algorithm=DEFAULT_DIGEST_ALGORITHM)
        e.source_digest = sdigests[j]
        v = e.value
        v.name = f"{snames[j]}/compiled"
        pdig = _hash_parts(payload_parts(snames[j], sdigests[j], v.name, hashed),
                           DEFAULT_DIGEST_ALGORITHM)[0]
        e.metadata_props.add(key=PAYLOAD_DIGEST_KEY, value=pdig.hex())
        v.struct_type.CopyFrom(st)
        v.data_location = TensorProto.EXTERNAL
        v.external_data.add(key="location", value=cname)
        v.external_data.add(key="offset", value=str(first))
        v.external_data.add(key="length", value=str(length))
        entries.append(e)
    return entries


def _make_parent(out: pathlib.Path) -> list:
    """Create ``out``'s folder; returns the folders made, innermost first (OutputError when it
    cannot be made)."""
    created = []
    parent = out.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None
    return created


def _stage_sidecars(sidecars: dict, out: pathlib.Path, staged: list) -> None:
    """Write each sidecar's bytes to a temporary file beside ``out`` (mode as the umask allows),
    staged for renaming into place."""
    umask = os.umask(0)
    os.umask(umask)
    for name, data in sidecars.items():
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".olv-", suffix=".sidecar")
        staged.append((tmp, out.parent / name))
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o666 & ~umask)


def compile_model(model, out_path, *, options=None, progress=None) -> CompileReport:
    """Write ``out_path``: the model plus a device entry for this CPU and one compiled entry per
    prepacked initializer (seed 004), payloads in ``<out name>.compiled`` beside it.

    The source initializers are kept (external data in ``<out name>.data``, scales included, so
    that a session using the entries never parses or touches them). Entries already in the model
    for other devices are kept, their payload bytes copied into the new payload file (an entry
    whose payload cannot be read is dropped with a :class:`CompileWarning`); those for this
    device are replaced. The input model's sidecars (``tokenizer.json``, ...) are copied beside
    the output when it is written to another folder.

    Nothing is written until everything is ready: the files are written to temporary names and
    renamed into place at the end (on a failure the temporary files are removed and existing
    files stay as they were).

    Parameters
    ----------
    model : Model, ModelProto or path
    out_path : path-like
        Destination ``.onnx``. May equal the input path (its files are replaced atomically);
        otherwise the output model, its ``.data``, ``.compiled`` and sidecar files must not be
        any file the input model reads.
    options : SessionOptions, optional
        Session options whose packing is persisted (default options).
    progress : callable, optional
        ``progress(str)`` messages.

    Returns
    -------
    CompileReport

    Raises
    ------
    OutputError
        An output file would overwrite a file the input model reads (its model file, external
        data or compiled payload file); an output path is a directory, its parent is not a
        directory, or a file cannot be written (the message names it). Nothing is written.
    OlvError
        The model does not validate or cannot run (the session's errors).
    """
    m = as_model(model)
    out = pathlib.Path(out_path)
    # a converted GGUF file references the .gguf in place: keep those references when they
    # resolve from the output's folder (never copy the GGUF's tensors into a .data file)
    gguf_here = (m.metadata().get("olv.source") == "gguf" and m.path is not None
                 and out.parent.resolve() == m.path.parent.resolve())
    _check_outputs(m, out, gguf_here)

    def warn(msg):
        warnings.warn(msg, CompileWarning, stacklevel=3)

    sidecars = _plan_sidecars(m, out, warn)
    opts = dataclasses.replace(options or SessionOptions(), use_compiled=False)
    sess = InferenceSession(m, opts)
    created = _make_parent(out)  # folders made for the output (removed again on failure)
    cname = out.name + ".compiled"
    here = this_device()
    proto, kept, dev_index = _other_devices(m, here)
    skipped, dropped, carried = [], [], []
    written = 0
    staged: list = []
    used_sources: set = set()
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".olv-", suffix=".compiled")
        staged.append((tmp, out.parent / cname))
        with _HugePageWriter(os.fdopen(fd, "wb", buffering=0)) as fh:
            pw = _PayloadFile(fh)
            for step in sess.all_steps():
                entries = _compile_step(m, step, pw, used_sources, skipped, dev_index, cname)
                proto.compiled_tensors.extend(entries)
                written += len(entries)
                if entries and progress is not None:
                    lay = layout_of(step.impl.packed)
                    progress(f"compiled {step.name}: {lay.name}, {len(entries)} entr"
                             f"{'y' if len(entries) == 1 else 'ies'}")
            offset = pw.offset
            # other devices' entries: their payload bytes follow, at the same offset modulo
            # the alignment (their fields' alignment holds), in the new payload file
            carried, dropped, offset = _carry_kept(m, kept, fh, offset, cname, proto.devices)
            total = offset
        os.chmod(tmp, 0o644)
        new_entries = list(proto.compiled_tensors)
        del proto.compiled_tensors[:]
        proto.compiled_tensors.extend(carried + new_entries)
        # payloads resolved as in m; scales external too (views of the file, never parsed)
        staged += stage_save(Model(proto, m.path), out, external_data=True,
                             external_params=True, keep_external=gguf_here)
        _stage_sidecars(sidecars, out, staged)
        # the model file last: a reader never sees the new model with old payload files
        staged.sort(key=lambda st: pathlib.Path(st[1]) == out)
        commit_staged(staged)
    except OSError as exc:
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"cannot write {str(out)!r}: {exc.strerror or exc}"
                          + (f" ({exc.filename})" if getattr(exc, "filename", None) else "")
                          ) from None
    finally:
        discard_staged(staged)
        if not out.exists():
            for d in created:  # folders made for a write that failed (only if still empty)
                try:
                    d.rmdir()
                except OSError:
                    break
    if dropped:
        warn(f"dropped {len(dropped)} compiled entr{'y' if len(dropped) == 1 else 'ies'} of "
             f"other devices whose payload could not be carried into {cname}: "
             f"{dropped[0][0]!r} ({dropped[0][1]}): {dropped[0][2]}"
             + (f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""))
    # record the verifications of what was just written (the first load is then cheap too):
    # one session on the written model checks every entry under the loading rules
    InferenceSession(load(out), opts.__class__(**{**dataclasses.asdict(opts),
                                                  "use_compiled": True}))
    return CompileReport(out, out.parent / cname, written, total,
                         f"{here.type}:{here.architecture}", skipped, len(carried), dropped,
                         sorted(sidecars))
