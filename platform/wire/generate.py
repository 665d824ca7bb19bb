"""Generate the Python gRPC modules in this folder from proto/splitserve/v1/*.proto.

    python -m splitserve.platform.wire.generate [--check]

protoc writes `from splitserve.v1 import worker_pb2`-style imports that follow the proto
package; we place the modules in `splitserve.platform.wire` instead and rewrite those imports.
`--check` regenerates into a temporary folder and exits 1 if anything differs (the drift test
runs exactly this).
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

WIRE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = WIRE.parents[1] / "proto"
PROTOS = ["splitserve/v1/worker.proto"]


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for src in sorted(pathlib.Path(tmp, "splitserve", "v1").glob("*_pb2*.py*")):
            text = re.sub(
                r"from splitserve\.v1 import (\w+)", r"from splitserve.platform.wire import \1", src.read_text()
            )
            dest = out / src.name
            dest.write_text(text)
            written.append(dest)
        return written


def main(argv: list[str]) -> int:
    if "--check" not in argv:
        for path in generate(WIRE):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
        stale = [p.name for p in fresh if not (WIRE / p.name).exists() or (WIRE / p.name).read_text() != p.read_text()]
    if stale:
        print(f"out of date with proto/: {', '.join(stale)}; run python -m splitserve.platform.wire.generate")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
