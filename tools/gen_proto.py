"""Generate the Python protobuf and gRPC stubs from proto/ into engramd_shared/pb.

`make proto` runs this; tests/test_proto_stubs.py runs `generate()` into a
temporary folder and fails when the committed stubs differ.
"""

import argparse
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = ["engramd/v1/engramd.proto", "engramd/v1/peer.proto"]
OUT = ROOT / "engramd_shared" / "pb"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs flat into `out`, with imports relative to it."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTOS}")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted(pathlib.Path(tmp).rglob("*.py*")):
            # protoc writes package-absolute imports (`from engramd.v1 import`),
            # which would resolve to the daemon package; the stubs live flat
            # inside engramd_shared.pb, so make them relative.
            text = src.read_text().replace("from engramd.v1 import", "from . import")
            dst = out / src.name
            dst.write_text(text)
            written.append(dst)
        init = out / "__init__.py"
        init.write_text('"""Generated from proto/ by tools/gen_proto.py; do not edit."""\n')
        written.append(init)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    if args.out == OUT and OUT.exists():
        shutil.rmtree(OUT)
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
