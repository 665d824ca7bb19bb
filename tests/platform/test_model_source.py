"""Model aliases resolved by several processes at once (model_source.py)."""

import os
import subprocess
import sys

RESOLVE = "from splitserve.platform.model_source import resolve_model; print(resolve_model('gemma3-270m').path)"


def test_two_processes_assembling_the_gemma_gguf_at_once_both_get_the_checked_file(tmp_path):
    """The prefill and decode workers of one `splitserve up` resolve the alias together on a fresh
    machine: the parts package writes its file in place, so without a lock the second one read a
    half-written GGUF and failed its checksum."""
    env = {**os.environ, "HOME": str(tmp_path)}  # a fresh ~/.cache: the file is assembled here
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [code for code, _, _ in results] == [0, 0, 0], [err[-600:] for _, _, err in results]
    paths = {out.strip() for _, out, _ in results}
    assert len(paths) == 1 and paths.pop().startswith(str(tmp_path))
