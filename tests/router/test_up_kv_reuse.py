"""`splitserve up`'s KV reuse flags (docs/kv-tiers.md): each worker it starts gets the second
tier and pull flags as the worker's own parser reads them, the router plans no pull under
--no-kv-pull, and a bad value exits with status 2 naming what is allowed, before anything starts."""

from splitserve.launch import up
from splitserve.platform.cli import build_parser, main
from splitserve.platform.settings.worker_args import WorkerArgs


def parse(*argv):
    return build_parser().parse_args(["up", "--no-tls", *argv])


def worker_settings(args) -> dict[str, WorkerArgs]:
    """What each worker `up` starts runs with: its command line (WorkerProcess runs `splitserve
    worker` with the settings' to_argv()) read back by the worker's own parser."""
    made = up.role_settings(args, up.config_from_args(args), up.shared_settings(args))
    return {
        role: WorkerArgs.from_namespace(build_parser().parse_args(["worker", *settings.to_argv()]))
        for role, settings in made.items()
    }


def test_each_worker_gets_the_tier_and_pull_flags_its_parser_accepts(tmp_path):
    args = parse("--kv-tier-bytes", "1GiB", "--kv-tier-dir", str(tmp_path / "kv"), "--max-pull-blocks", "64")
    made = worker_settings(args)
    assert set(made) == {"prefill", "decode"}
    for worker in made.values():
        assert worker.kv_tier_bytes == 1024**3 and worker.kv_tier_dir == str(tmp_path / "kv")
        assert worker.max_pull_blocks == 64 and worker.kv_pull
        tier = worker.kv_tier_config()
        assert tier.max_bytes == 1024**3 and tier.directory == str(tmp_path / "kv")


def test_without_the_flags_the_workers_get_their_defaults():
    for worker in worker_settings(parse()).values():
        assert worker.kv_tier_config() is None  # no second tier
        assert worker.max_pull_blocks == 1024 and worker.kv_pull


def test_a_host_memory_tier_and_no_pull():
    for worker in worker_settings(parse("--kv-tier-bytes", "512MiB", "--no-kv-pull")).values():
        tier = worker.kv_tier_config()
        assert tier.max_bytes == 512 * 1024**2 and tier.directory is None
        assert not worker.kv_pull


def test_no_kv_pull_turns_the_routers_pull_planning_off(monkeypatch):
    seen = {}

    def fake_up(args, config, settings, owner):
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
        (["--max-pull-blocks", "0"], "max_pull_blocks must be >= 1 (--max-pull-blocks; --no-kv-pull turns pulls off)"),
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
