"""Regenerate the checked-in gRPC/protobuf modules from protos/*.proto.

Usage: python scripts/gen_protos.py [OUTPUT_DIR]

Without OUTPUT_DIR the modules are written to remote_tpu/_core/proto/. The test suite
runs this into a temporary directory and fails when the checked-in copies differ.
"""

from __future__ import annotations

import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
DEFAULT_OUT = ROOT / "remote_tpu" / "_core" / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for grpc_file in out_dir.glob("*_pb2_grpc.py"):
        # protoc emits `import x_pb2`, which only works from the output directory;
        # make it a package-relative import.
        text = grpc_file.read_text()
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        grpc_file.write_text(text)
    for path in sorted(out_dir.iterdir()):
        if path.suffix in (".py", ".pyi") and path.name != "__init__.py":
            written.append(path)
    return written


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for p in generate(target):
        print(p.relative_to(target))
