"""Generate olv_runtime/proto/onnx_light_pb2.py(.pyi) from proto/onnx_light.proto.

Usage::

    python scripts/gen_proto.py            # write the bindings
    python scripts/gen_proto.py --check    # exit 1 if the committed bindings are stale

Needs grpcio-tools (the ``dev``/``test`` extra pins the version that produced the committed
bindings; a different protoc writes a different version header, which ``--check`` reports).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "olv_runtime" / "proto"
OUTPUTS = ("onnx_light_pb2.py", "onnx_light_pb2.pyi")


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc (grpc_tools) on proto/onnx_light.proto, writing into ``out_dir``."""
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(PROTO_DIR / "onnx_light.proto"),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def stale_files() -> list[str]:
    """Names of committed binding files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        generate(tmp_path)
        stale = []
        for name in OUTPUTS:
            fresh = (tmp_path / name).read_bytes()
            committed = OUT_DIR / name
            if not committed.exists() or committed.read_bytes() != fresh:
                stale.append(name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale bindings")
    ns = parser.parse_args(argv)
    if ns.check:
        stale = stale_files()
        if stale:
            print("stale generated bindings: " + ", ".join(stale) + " (run scripts/gen_proto.py)")
            return 1
        print("generated bindings are up to date")
        return 0
    generate(OUT_DIR)
    print(f"wrote {', '.join(OUTPUTS)} to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
