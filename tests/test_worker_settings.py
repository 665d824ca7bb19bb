"""One spec for a worker's settings (platform/settings/worker_args.py), four ways to fill it in.

The same settings go through `splitserve worker`'s command line, `splitserve up`'s worker command
lines, the operator's rendered pod args and the Ray replica's app args; each path's result is read
back the way the worker reads it, and its EngineConfig and WorkerConfig are compared field by field
with the settings'. The samples set every field of WorkerArgs to a value other than its default (a
test below checks that they do, so a new field needs a sample here), so a path that drops a field
fails with that field's name."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest
import yaml

from splitserve.launch import up
from splitserve.operator.render import render
from splitserve.operator.spec import parse_spec
from splitserve.platform.cli import build_parser
from splitserve.platform.errors import ConfigError
from splitserve.platform.settings import worker_args
from splitserve.platform.settings.worker_args import WorkerArgs, for_role
from splitserve.rayserve import config as ray_config
from splitserve.workers.config import WorkerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC_JSON = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2})
SECRET = "a" * 64


def samples(tmp_path) -> list[WorkerArgs]:
    """Two settings that together move every field off its default (kv_pull off and a pull limit
    exclude each other, so each sample has one of them)."""
    secret = tmp_path / "kv-secret"
    secret.write_text(SECRET)
    common = WorkerArgs(
        role="decode",
        model="random:llama-3-8b",
        dtype="bfloat16",
        max_model_len=4096,
        block_size=32,
        max_num_seqs=7,
        kv_cache_memory_gib=1.5,
        host="10.0.0.2",
        advertise_host="worker.example",
        grpc_port=5001,
        metrics_port=9001,
        kv_transport="tcp",
        kv_port=13001,
        kv_secret_file=str(secret),
        tls_cert="/t/cert.pem",
        tls_key="/t/key.pem",
        tls_ca="/t/ca.pem",
        tls_check_peer_roles=True,
        speculative_config=SPEC_JSON,
        kv_tier_bytes=2 * 1024**3,
        kv_tier_dir=str(tmp_path / "tier"),
        scheduling_policy="priority",
        device="cuda:1",
        quantization="none",
        kv_cache_dtype="bfloat16",
        threads=3,
        tensor_parallel_size=4,
        nnodes=2,
        node_rank=1,
        master_addr="leader.example",
        master_port=29500,
        enforce_eager=True,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        share_prefix_in_flight=False,
        lora_modules=("sql=/lora/sql", "chat=/lora/chat"),
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=3,
        disaggregation="always",
        min_prefill_tokens=64,
        transfer_deadline_s=12.5,
        drain_grace_s=7.5,
        kv_layer_streaming=False,
    )
    return [common.replace(kv_pull=False), common.replace(max_pull_blocks=64)]


def differences(got, want, path: str = "") -> list[str]:
    """The dotted paths where two (nested) dataclasses differ, field by field."""
    if dataclasses.is_dataclass(want) and type(got) is type(want):
        out = []
        for f in dataclasses.fields(want):
            out += differences(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}".lstrip("."))
        return out
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def assert_same_worker(got: WorkerArgs, want: WorkerArgs) -> None:
    assert differences(got.engine_config(), want.engine_config()) == []
    assert differences(WorkerConfig.from_args(got), WorkerConfig.from_args(want)) == []
    assert differences(got, want) == []


def worker_reads(argv: list[str]) -> WorkerArgs:
    """What `splitserve worker ARGV` runs with (cmd_worker's first line)."""
    return WorkerArgs.from_namespace(build_parser(["worker"]).parse_args(["worker", *argv]))


def test_the_samples_move_every_field_off_its_default(tmp_path):
    moved = set().union(*(s.non_defaults() for s in samples(tmp_path)))
    assert moved == {f.name for f in worker_args.flags()}


def test_the_worker_command_line_carries_every_field(tmp_path):
    for settings in samples(tmp_path):
        assert_same_worker(worker_reads(settings.to_argv()), settings)


def up_args(settings: WorkerArgs, tmp_path) -> list[str]:
    """`splitserve up`'s command line for `settings`: the worker flags it passes on, plus what it
    decides from its own flags (threads, transport, certificates) and the router's (model,
    lengths, block size)."""
    router = tmp_path / "router.yaml"
    router.write_text(yaml.safe_dump({"block_size": settings.block_size}))
    passed = WorkerArgs(**{name: getattr(settings, name) for name in up.UP_PASSES}).to_argv()
    return [
        *("--config", str(router), "--model", settings.model, "--max-model-len", str(settings.max_model_len)),
        *("--threads", str(settings.threads), "--kv-transport", settings.kv_transport),
        *("--tls-cert", settings.tls_cert, "--tls-key", settings.tls_key, "--tls-ca", settings.tls_ca),
        *passed,
    ]


def test_up_passes_every_field_to_its_workers(tmp_path):
    for settings in samples(tmp_path):
        args = build_parser(["up"]).parse_args(["up", *up_args(settings, tmp_path)])
        made = up.role_settings(args, up.config_from_args(args), up.shared_settings(args).replace(**up_tls(settings)))
        # What up decides itself: loopback, port 0, a short drain, no KV secret with the caller's certificates.
        decided = dict(host="127.0.0.1", advertise_host="", grpc_port=0, metrics_port=0, kv_port=0, drain_grace_s=5.0)
        want = settings.replace(kv_secret_file="", tls_check_peer_roles=False, **decided)
        for role in ("prefill", "decode"):
            assert_same_worker(worker_reads(made[role].to_argv()), for_role(want, role))


def up_tls(settings: WorkerArgs) -> dict:
    args = build_parser(["up"]).parse_args(["up", "--tls-cert", settings.tls_cert, "--tls-key", settings.tls_key])
    args.tls_ca = settings.tls_ca
    return up.up_security(args, "")[1]


def test_the_ray_replica_gets_every_field(tmp_path):
    for settings in samples(tmp_path):
        engine = {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(settings).items()
            if name not in ray_config.RAY_DECIDES
        }
        security = {"tls_cert": settings.tls_cert, "tls_key": settings.tls_key, "tls_ca": settings.tls_ca}
        config = ray_config.parse(
            {
                "model": settings.model,
                "kv_transport": settings.kv_transport,
                "engine": engine,
                "security": {**security, "kv_secret_file": settings.kv_secret_file},
                # tensor parallelism is each pool's; a replica's ranks share its node (STRICT_PACK)
                "prefill": {"tensor_parallel_size": settings.tensor_parallel_size},
                "decode": {"tensor_parallel_size": settings.tensor_parallel_size},
            }
        )
        for app in ray_config.render(config)["applications"][1:]:
            a = json.loads(json.dumps(app["args"]))  # what Serve hands the replica: plain JSON values
            got = ray_config.replica_settings(
                a["role"], a["model"], a["kv_transport"], a["engine"], a["host"], "10.1.2.3", a["security"]
            )
            decided = dict(host="0.0.0.0", advertise_host="10.1.2.3", grpc_port=0, metrics_port=0, kv_port=0)
            one_node = dict(nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=0)
            want = settings.replace(tls_check_peer_roles=False, drain_grace_s=10.0, **decided, **one_node)
            assert_same_worker(got, for_role(want, a["role"]))


def rendered_worker_args(spec: dict) -> dict[str, list[str]]:
    objs = render(parse_spec(spec), "svc", "ns", "6f1c7c4e-0000-4000-8000-000000000001")
    return {
        m["metadata"]["name"].removeprefix("svc-"): m["spec"]["template"]["spec"]["containers"][0]["args"]
        for m in objs
        if m["kind"] == "Deployment" and m["metadata"]["name"] in ("svc-prefill", "svc-decode")
    }


def test_the_operator_renders_every_field_its_spec_has():
    """The InferenceService has a field for some worker settings; each one set away from its
    default must reach the worker, the rest are the worker's defaults or the pod's layout."""
    spec = {
        "model": {"uri": "random:llama-3-8b", "dtype": "bfloat16", "maxModelLen": 4096},
        "engine": {"blockSize": 32, "maxNumSeqs": 7, "kvCacheMemoryGiB": 1.5},
        "kvTransfer": {"transport": "tcp"},
        "speculative": {"numSpeculativeTokens": 3, "promptLookupMax": 5, "promptLookupMin": 2},
        "kvCache": {"tierGiB": 2, "maxPullBlocks": 64},
        "flowControl": {"enabled": True},
        "prefill": {"tensorParallelSize": 2},
        "decode": {"gpus": 1},
    }
    pod_layout = dict(
        host="0.0.0.0",
        advertise_host="$(POD_IP)",
        grpc_port=50051,
        metrics_port=9090,
        kv_port=13337,
        kv_secret_file="/etc/splitserve/kv/secret",
        tls_cert="/etc/splitserve/tls/tls.crt",
        tls_key="/etc/splitserve/tls/tls.key",
        tls_ca="/etc/splitserve/tls/ca.crt",
        tls_check_peer_roles=True,
    )
    from_spec = WorkerArgs(
        model="random:llama-3-8b",
        dtype="bfloat16",
        max_model_len=4096,
        block_size=32,
        max_num_seqs=7,
        kv_cache_memory_gib=1.5,
        kv_transport="tcp",
        speculative_config=SPEC_JSON,
        kv_tier_bytes=2 * 1024**3,
        max_pull_blocks=64,
        scheduling_policy="priority",
        **pod_layout,
    )
    args = rendered_worker_args(spec)
    for pool, want in (
        (
            "prefill",
            for_role(from_spec.replace(kv_tier_dir="/var/cache/splitserve-kv", tensor_parallel_size=2), "prefill"),
        ),
        ("decode", for_role(from_spec.replace(device="cuda"), "decode")),
    ):
        assert args[pool][0] == "worker"
        got = worker_reads(args[pool][1:])
        assert differences(got.engine_config(read_secret=False), want.engine_config(read_secret=False)) == []
        assert differences(WorkerConfig.from_args(got), WorkerConfig.from_args(want)) == []


def test_the_worker_parser_is_the_spec(monkeypatch):
    """Every flag of `splitserve worker` (besides the tracing flags every serving command shares,
    platform/tracing.py) is a WorkerArgs field, with the field's default."""
    for name in ("SPLITSERVE_TLS_CERT", "SPLITSERVE_TLS_KEY", "SPLITSERVE_TLS_CA", "SPLITSERVE_KV_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser(["worker"])
    worker = parser._subparsers._group_actions[0].choices["worker"]
    actions = {a.option_strings[0]: a for a in worker._actions if a.option_strings and a.dest != "help"}
    spec = {f.metadata["flag"].name: f for f in worker_args.flags()}
    assert set(actions) - set(spec) == {
        "--otlp-traces-endpoint",
        "--otlp-traces-sample-ratio",
        "--otlp-traces-include-prompt",
    }
    for flag, f in spec.items():
        assert (actions[flag].dest, actions[flag].default) == (f.name, f.default), flag


def string_constants(path: pathlib.Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_no_other_module_spells_a_worker_flag():
    """The modules that start or describe workers build their command lines from WorkerArgs: none of
    them spells a worker flag. (A flag of the same name that another command defines, e.g. the
    router's --model or the EPP's --grpc-port, and up's own --threads and --kv-transport, are not
    worker flags; `generate`, `chat` and `up` take theirs from WorkerArgs.)"""
    commands = build_parser()._subparsers._group_actions[0].choices
    others = {
        flag
        for name, command in commands.items()
        if name not in ("worker", "generate", "chat", "up")
        for action in command._actions
        for flag in action.option_strings
    }
    worker_only = {f.metadata["flag"].name for f in worker_args.flags()} - others - {"--threads", "--kv-transport"}
    spelled = {}
    for folder in ("workers", "launch", "operator", "rayserve", "platform"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != ROOT / "platform/settings/worker_args.py":
                found = string_constants(path) & worker_only
                if found:
                    spelled[str(path.relative_to(ROOT))] = sorted(found)
    assert spelled == {}


def test_cross_flag_rules_hold_wherever_settings_are_made():
    with pytest.raises(ConfigError, match="--kv-tier-dir needs --kv-tier-bytes"):
        WorkerArgs(kv_tier_dir="/x")
    with pytest.raises(ConfigError, match="allowed: one of the two"):
        WorkerArgs(kv_pull=False, max_pull_blocks=8)
    assert worker_args.with_flow_control(WorkerArgs(), True).scheduling_policy == "priority"
    assert worker_args.with_flow_control(WorkerArgs(), False).scheduling_policy == "fcfs"
    assert for_role(WorkerArgs(speculative_config=SPEC_JSON), "prefill").speculative_config is None
    with pytest.raises(ConfigError, match="quantization 'int4' runs on the CPU only"):
        WorkerArgs(device="cuda", quantization="int4")
