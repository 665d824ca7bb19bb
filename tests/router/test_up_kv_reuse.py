"""`splitserve up`'s KV reuse flags (docs/kv-tiers.md): each worker it starts gets the second
tier and pull flags as the worker's own parser reads them, the router plans no pull under
--no-kv-pull, and a bad value exits with status 2 naming what is allowed, before anything starts."""

import pytest

from splitserve.launch import up
from splitserve.platform.cli import build_parser, kv_tier_config, main


def parse(*argv):
    return build_parser().parse_args(["up", "--no-tls", *argv])


class Started(Exception):
    pass


def worker_argvs(monkeypatch, args) -> dict[str, list[str]]:
    """The command line `up` builds for each worker: the WorkerProcess objects are recorded and
    the gateway's bind, the next step before any process starts, stops it."""
    made = {}

    class Recorder:
        def __init__(self, role, argv, level):
            made[role] = argv

    def stop(host, port):
        raise Started

    monkeypatch.setattr(up, "WorkerProcess", Recorder)
    monkeypatch.setattr(up, "bind", stop)
    with pytest.raises(Started):
        up._up(args, up.config_from_args(args), [])
    return made


def test_each_worker_gets_the_tier_and_pull_flags_its_parser_accepts(monkeypatch, tmp_path):
    args = parse("--kv-tier-bytes", "1GiB", "--kv-tier-dir", str(tmp_path / "kv"), "--max-pull-blocks", "64")
    made = worker_argvs(monkeypatch, args)
    assert set(made) == {"prefill", "decode"}
    for argv in made.values():
        worker = build_parser().parse_args(["worker", *argv])
        assert worker.kv_tier_bytes == 1024**3 and worker.kv_tier_dir == str(tmp_path / "kv")
        assert worker.max_pull_blocks == 64 and not worker.no_kv_pull
        tier = kv_tier_config(worker)
        assert tier.max_bytes == 1024**3 and tier.directory == str(tmp_path / "kv")


def test_without_the_flags_the_workers_get_their_defaults(monkeypatch):
    for argv in worker_argvs(monkeypatch, parse()).values():
        worker = build_parser().parse_args(["worker", *argv])
        assert kv_tier_config(worker) is None  # no second tier
        assert worker.max_pull_blocks == 1024 and not worker.no_kv_pull


def test_a_host_memory_tier_and_no_pull(monkeypatch):
    for argv in worker_argvs(monkeypatch, parse("--kv-tier-bytes", "512MiB", "--no-kv-pull")).values():
        worker = build_parser().parse_args(["worker", *argv])
        tier = kv_tier_config(worker)
        assert tier.max_bytes == 512 * 1024**2 and tier.directory is None
        assert worker.no_kv_pull


def test_no_kv_pull_turns_the_routers_pull_planning_off(monkeypatch):
    seen = {}

    def fake_up(args, config, secure_args):
        seen["config"] = config
        return 0

    monkeypatch.setattr(up, "_up", fake_up)
    assert up.cmd_up(parse("--no-kv-pull")) == 0
    assert seen["config"].placement.kv_pull.enabled is False
    assert up.cmd_up(parse()) == 0
    assert seen["config"].placement.kv_pull.enabled is True


def test_bad_values_exit_2_naming_what_is_allowed(capsys, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(up, "_up", lambda *a: started.append(a) or 0)
    a_file = tmp_path / "f"
    a_file.write_text("")
    cases = [
        (["--kv-tier-bytes", "0"], "'0' is not a size; allowed: a positive number of bytes"),
        (["--kv-tier-bytes", "lots"], "allowed: a positive number of bytes, or a number with one of the units"),
        (["--max-pull-blocks", "0"], "argument --max-pull-blocks: 0 is too small; allowed: an integer >= 1"),
        (["--kv-tier-dir", str(tmp_path)], "--kv-tier-dir needs --kv-tier-bytes"),
        (["--kv-tier-bytes", "1GiB", "--kv-tier-dir", str(a_file)], f"--kv-tier-dir {a_file} is not a folder; allowed"),
        (["--no-kv-pull", "--max-pull-blocks", "8"], "--no-kv-pull turns them off; allowed: one of the two"),
    ]
    for argv, message in cases:
        try:
            rc = main(["up", "--no-tls", *argv])
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code
        assert rc == 2, argv
        assert message in capsys.readouterr().err, argv
    assert started == []
