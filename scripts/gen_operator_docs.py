"""Write docs/operators.md: the operators olv_runtime implements and their opset ranges, from
the registry (olv_runtime.ops.registry.registered_ranges). Run after adding an operator:

    python scripts/gen_operator_docs.py

tests/ops/test_ops_versions.py checks the committed file is current.
"""
from __future__ import annotations

import pathlib
import sys

HEADER = """# Supported operators

Generated from the operator registry by `python scripts/gen_operator_docs.py`; do not edit.
Each operator runs for the opset versions listed (inclusive) of its domain; a model importing
an opset outside every range fails at session creation with `UnsupportedOperatorError` naming
the ranges. The standard-domain ranges end at opset {max_opset}, the newest one the semantics
were checked against (onnx 1.23). onnx's backend node tests for these operators run in
`tests/ops/test_onnx_conformance.py` (pass, or a listed rejection naming the unsupported attribute or
dtype; no wrong values).

"""


def render() -> str:
    from olv_runtime.ops.registry import MAX_OPSET, registered_ranges

    by_domain: dict[str, list] = {}
    for domain, op, lo, hi in registered_ranges():
        by_domain.setdefault(domain, []).append((op, lo, hi))
    out = [HEADER.format(max_opset=MAX_OPSET)]
    titles = {"": "ai.onnx (standard)", "com.microsoft": "com.microsoft (onnxruntime contrib)",
              "olv": "olv (seed 000 extensions)"}
    for domain in sorted(by_domain, key=lambda d: (d != "", d)):
        rows = by_domain[domain]
        out.append(f"## {titles.get(domain, domain)}\n\n| operator | opsets |\n|---|---|\n")
        merged: dict[str, list[str]] = {}
        for op, lo, hi in rows:
            merged.setdefault(op, []).append(f"{lo}-{hi}" if hi is not None else f"{lo}+")
        for op in sorted(merged):
            out.append(f"| {op} | {', '.join(merged[op])} |\n")
        out.append("\n")
    return "".join(out)


if __name__ == "__main__":
    target = pathlib.Path(__file__).resolve().parent.parent / "docs" / "operators.md"
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == text else 1)
    target.write_text(text)
    print(f"wrote {target}")
