"""`splitserve serve --backend ray` as a process, the way Kubernetes runs it (raycli.py): while it
comes up /v1/models lists the model only when /ready agrees, the first request sent the moment
the model is listed gets 200, the replicas run mTLS and KV auth (none logs INSECURE), and SIGTERM
stops Serve and Ray with exit code 0, no stack dump, and no Ray process left. A second start is
stopped by SIGTERM before it is ready: also exit 0. The twenty-start form is e2e/ray_coldstarts.py."""

import time

import pytest
from raycli import cold_start, problems
from raykit import ray_processes, wait_for

pytestmark = pytest.mark.slow


def test_cold_start_serves_its_first_request_then_sigterm_exits_0(tmp_path_factory):
    temp_dir, since = str(tmp_path_factory.mktemp("ray")), time.time()
    result = cold_start(temp_dir)
    assert problems(result) == [], result.output[-3000:]
    assert "splitserve serve: stopped" in result.output
    wait_for(lambda: not ray_processes(since, temp_dir), 60, "every Ray process to exit")


def test_sigterm_during_start_up_exits_0(tmp_path_factory):
    temp_dir, since = str(tmp_path_factory.mktemp("ray")), time.time()

    def stop_soon(proc):
        import signal

        import psutil

        def ours_started():  # a process of this run's Ray (its temp dir on the command line), not the CLI's
            return any(
                temp_dir in " ".join(p.info["cmdline"] or []) and p.pid != proc.pid
                for p in psutil.process_iter(["cmdline"])
            )

        wait_for(ours_started, 120, "this run's Ray to start")
        proc.send_signal(signal.SIGTERM)

    result = cold_start(temp_dir, before_ready=stop_soon)
    assert problems(result, expect_served=False) == [], result.output[-3000:]
    assert "splitserve serve: stopped during start-up" in result.output
    wait_for(lambda: not ray_processes(since, temp_dir), 60, "every Ray process to exit")
