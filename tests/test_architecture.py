"""The package's shape (docs/architecture.md): layers that only call downward, no import cycle,
no import hidden inside a function, configuration read in one module.

The module graph is read from the source (ast), not from a running interpreter: every
``import`` / ``from ... import`` at module level and every ``lazy_module("...")`` declaration
(olv_runtime.lazy) is an edge.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import olv_runtime
from olv_runtime.config import LAZY_IMPORTS

PKG = pathlib.Path(olv_runtime.__file__).parent
ROOT = "olv_runtime"

#: Bottom to top (docs/architecture.md). A module may import modules of its own layer (no cycle)
#: and of the layers below it, never above.
LAYERS = (
    ("errors", "config", "lazy"),
    ("proto",),
    ("counters", "pool", "progress"),
    ("io",),
    ("kernels",),
    ("structs",),
    ("kv",),
    ("ops",),
    ("decoding",),
    ("executor",),
    ("state",),
    ("generation",),
    ("engine",),
    ("server",),  # the HTTP server on the engine (optional extra: starlette, uvicorn, ...)
    ("builder",),
    ("models",),
    ("__init__",),  # the package's public names (olv_runtime/__init__.py)
    ("cli",),
)

#: modules that import by name at run time, on purpose (importlib), and why
DYNAMIC_IMPORTS = {
    "olv_runtime.lazy": "lazy_module: the first attribute access imports the declared module",
    "olv_runtime.kernels.numba_startup": "numba's arraymath must be first imported while the hook is in place",
    "olv_runtime.kernels.config": "capability probe of numba's OpenMP pool (needs libgomp)",
    "olv_runtime.kernels.precompile": "a compile worker imports the kernel modules it is asked to compile",
    "olv_runtime.ops.registry": "operator families are imported at their first lookup (ops.LAZY_MODULES)",
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, node) -> list[str]:
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    out = []
    for n in names:
        while n not in MODULES and "." in n:
            n = n.rsplit(".", 1)[0]
        if n in MODULES and n.startswith(ROOT):
            out.append(n)
    return out


def _scan():
    """(module-level edges, lazy edges, function-level imports, importlib users, environ users)"""
    edges, lazy, inner, dynamic, environ = {}, {}, [], set(), set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        edges[module], lazy[module] = set(), set()

        def walk(node, in_func):
            for ch in ast.iter_child_nodes(node):
                func = in_func or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda))
                if isinstance(ch, (ast.Import, ast.ImportFrom)):
                    if in_func:
                        top = (ch.names[0].name if isinstance(ch, ast.Import)
                               else ("." if ch.level else ch.module or "")).split(".")[0]
                        inner.append((module, ch.lineno, ast.unparse(ch), top))
                    else:
                        edges[module].update(_resolve(module, is_pkg, ch))
                elif isinstance(ch, ast.Call):
                    fn = ast.unparse(ch.func)
                    if fn == "lazy_module" and ch.args and isinstance(ch.args[0], ast.Constant):
                        lazy[module].add(ch.args[0].value)
                    if fn in ("importlib.import_module", "__import__", "importlib.__import__"):
                        dynamic.add(module)
                elif isinstance(ch, ast.Attribute) and ast.unparse(ch) in ("os.environ",
                                                                           "os.getenv"):
                    environ.add(module)
                elif isinstance(ch, ast.Name) and ch.id in ("environ", "getenv"):
                    environ.add(module)
                walk(ch, func)

        walk(tree, False)
    return edges, lazy, inner, dynamic, environ


EDGES, LAZY, INNER, DYNAMIC, ENVIRON = _scan()


def _layer(module: str) -> int:
    rest = module[len(ROOT) + 1:] if module != ROOT else "__init__"
    head = rest.split(".")[0]
    for i, names in enumerate(LAYERS):
        if head in names:
            return i
    raise AssertionError(f"{module}: in no layer of LAYERS (add its package to "
                         "docs/architecture.md and to this test)")


def _graph() -> dict[str, set[str]]:
    return {m: (EDGES[m] | LAZY[m]) - {m} for m in MODULES}


def _cycles(graph) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_inside_a_function_but_optional_packages():
    bad = [f"{m}:{line}: {text}" for m, line, text, top in INNER if top not in LAZY_IMPORTS]
    assert not bad, ("imports inside functions (move them to the top of the module; a module a "
                     "decode must not import yet is declared with olv_runtime.lazy.lazy_module; "
                     "an optional third-party package goes into olv_runtime.config.LAZY_IMPORTS):"
                     "\n" + "\n".join(bad))


def test_lazy_declarations_name_real_modules():
    missing = [f"{m}: lazy_module({t!r})" for m, ts in LAZY.items() for t in ts
               if t not in MODULES]
    assert not missing, missing


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_layers_only_call_downward():
    up = sorted(f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                if _layer(dst) > _layer(src) and dst != ROOT)
    # a submodule's import of its own package's __init__ is a same-layer edge; the root
    # package (public names) may be read by the CLI only
    up += sorted(f"{src} -> {ROOT}" for src, dsts in _graph().items()
                 if ROOT in dsts and _layer(src) < _layer(ROOT))
    assert not up, "imports that climb a layer:\n" + "\n".join(up)


def test_dynamic_imports_only_where_declared():
    assert DYNAMIC <= set(DYNAMIC_IMPORTS), sorted(DYNAMIC - set(DYNAMIC_IMPORTS))


def test_environment_read_in_config_only():
    assert ENVIRON <= {"olv_runtime.config"}, sorted(ENVIRON - {"olv_runtime.config"})


def test_session_private_fields_stay_in_the_executor():
    """The layers above the executor use InferenceSession's public API only."""
    bad = []
    for module, path in MODULES.items():
        if module.startswith("olv_runtime.executor"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and ast.unparse(node.value).split(".")[-1] in ("session", "_session", "sess")):
                bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


MAX_MODULE_LINES = 1000
MAX_FUNCTION_LINES = 120
MAX_JITTED_PARAMETERS = 16
GENERATED = {"olv_runtime.proto.onnx_light_pb2"}


def _jitted(node) -> bool:
    names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
    return any(n.split(".")[-1] in ("njit", "jit", "lazy_njit") for n in names)


def _n_params(node) -> int:
    a = node.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg)


def test_sizes_a_reader_can_hold():
    """No module over 1000 lines, no function over 120 lines, no jitted function over 16
    parameters (generated code aside)."""
    big, long_, wide = [], [], []
    for module, path in MODULES.items():
        if module in GENERATED:
            continue
        src = path.read_text()
        if src.count("\n") > MAX_MODULE_LINES:
            big.append(f"{module}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_.append(f"{module}.{node.name}: {n} lines")
                if _jitted(node) and _n_params(node) > MAX_JITTED_PARAMETERS:
                    wide.append(f"{module}.{node.name}: {_n_params(node)} parameters")
    assert not (big or long_ or wide), (big, long_, wide)


def test_the_checks_see_what_they_check(tmp_path):
    """The scanner itself: a function-level import, a cycle and an upward edge are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    from olv_runtime import x\n")
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found and found[0].lineno == 2
    assert _layer("olv_runtime.kernels.packed") < _layer("olv_runtime.executor.session")
    assert _layer("olv_runtime.cli") > _layer("olv_runtime")
    assert "olv_runtime.kernels.decoder_layers" in LAZY["olv_runtime.executor.decoder_step"]
    wide = ast.parse("@njit(**JIT)\ndef f(" + ", ".join(f"a{i}" for i in range(17)) + "):\n    pass\n")
    fn = wide.body[0]
    assert _jitted(fn) and _n_params(fn) == 17


def test_import_olv_runtime_imports_no_optional_package():
    code = ("import sys, olv_runtime; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(r.stdout.split())
    assert not loaded & LAZY_IMPORTS, sorted(loaded & LAZY_IMPORTS)
