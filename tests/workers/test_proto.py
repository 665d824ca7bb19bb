"""The generated gRPC modules (platform/wire/worker_pb2*.py) match proto/splitserve/v1/worker.proto:
an edit to the .proto without regenerating, or a hand edit to a generated module, fails here."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_modules_match_the_proto():
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.platform.wire.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_check_sees_a_stale_module(tmp_path, monkeypatch):
    """--check compares against the folder it generates into: a module that differs is named."""
    from splitserve.platform.wire import generate

    monkeypatch.setattr(generate, "WIRE", tmp_path)
    generate.generate(tmp_path)
    stale = tmp_path / "worker_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    assert generate.main(["--check"]) == 1
