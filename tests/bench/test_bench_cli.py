"""`splitserve bench` as a user runs it: the table, the JSON, and clear errors with status 2."""

import json
import pathlib
import subprocess
import sys

import pytest
from benchkit import Script, retry_timing

from splitserve.bench.loadgen import cli, workloads

SPLITSERVE = str(pathlib.Path(sys.executable).parent / "splitserve")
URL = ["--url", "http://127.0.0.1:9"]
W1 = [*URL, "--workload", "w1"]


def run_main(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*W1, "--rate", "1", "--concurrency", "2"], "argument --concurrency: not allowed with argument --rate"),
        (W1, "one of the arguments --rate --concurrency is required"),
        ([*W1, "--rate", "-1"], "argument --rate: must be a positive number (per second) or inf, got '-1'"),
        ([*W1, "--rate", "0"], "must be a positive number"),
        ([*W1, "--rate", "nan"], "must be a positive number"),
        ([*URL, "--workload", "w9", "--rate", "1"], "argument --workload: invalid choice: 'w9'"),
        ([*W1, "--rate", "1", "--slo", "ttft:0.5"], "argument --slo: bad SLO item 'ttft:0.5'"),
        ([*W1, "--rate", "1", "--slo", "ttft=0.5,p99=1"], "KEY one of ttft, tpot, e2e"),
        ([*W1, "--rate", "1", "--num-requests", "0"], "argument --num-requests: must be an integer >= 1, got '0'"),
        ([*W1, "--concurrency", "0"], "argument --concurrency: must be an integer >= 1"),
        ([*W1, "--rate", "1", "--warmup", "-2"], "argument --warmup: must be an integer >= 0"),
        ([*W1, "--concurrency", "2", "--burstiness", "0.5"], "--burstiness shapes the arrivals of --rate"),
        ([*W1, "--rate", "1", "--burstiness", "0"], "argument --burstiness: must be a positive number or inf"),
        ([*URL, "--workload", "w2", "--rate", "1", "--num-requests", "7"], "use 6 or 12"),
        ([*W1, "--rate", "1", "--workload-param", "zipf"], "expected KEY=VALUE"),
        ([*W1, "--rate", "1", "--workload-param", "size=3"], "w1 has no parameter 'size'"),
        (["--url", "127.0.0.1:8000", "--workload", "w1", "--rate", "1"], "argument --url: must start with http://"),
        ([*W1, "--rate", "1", "--output", "/nonexistent/dir/r.json"], "does not exist"),
        ([*W1, "--rate", "1", "--extra-body", "{top_k: 1}"], "argument --extra-body: must be a JSON object"),
        ([*W1, "--rate", "1", "--extra-body", "[1]"], "must be a JSON object, got list"),
        ([*W1, "--rate", "1", "--extra-body", '{"prompt": "hi"}'], "['prompt'] are set by the workload"),
        ([*W1, "--rate", "1", "--tokenizer", "smollm2-135m"], "--tokenizer is used only with --prompt-format text"),
        ([*W1, "--rate", "1", "--prompt-format", "text", "--model", "random:tiny"], "random:tiny has no tokenizer"),
        ([*W1, "--rate", "1", "--prompt-format", "text", "--model", "gpt-x"], "pass --tokenizer MODEL"),
    ],
)
def test_invalid_arguments_exit_2_with_a_message(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert message in err
    assert out == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "1", "--concurrency", "4"], "argument --concurrency: not allowed with argument --rate"),
        (["--rate", "1", "--slo", "ttft=0.5,tpot"], "bad SLO item 'tpot'"),
    ],
)
def test_the_installed_command_rejects_invalid_arguments(args, message):
    proc = subprocess.run(
        [SPLITSERVE, "bench", *URL, "--workload", "w1", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "usage: splitserve bench" in proc.stderr


def test_installed_command_runs_a_workload_and_writes_json(server, tmp_path):
    server.reset(lambda n, p: Script(0.01, (0.005,) * (p["max_tokens"] - 1), cached_tokens=32))
    out = tmp_path / "w3.json"
    proc = subprocess.run(
        [
            SPLITSERVE,
            "bench",
            "--url",
            server.url,
            "--workload",
            "w3",
            "--rate",
            "inf",
            "--num-requests",
            "10",
            "--warmup",
            "1",
            "--slo",
            "ttft=5,tpot=1",
            "--seed",
            "3",
            "--workload-param",
            "long_min=40",
            "--workload-param",
            "long_max=50",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 10 and doc["summary"]["failed"] == 0
    assert doc["summary"]["request_goodput"] == pytest.approx(10 / doc["duration_s"])
    assert doc["workload"]["params"]["long_min"] == 40 and doc["config"]["rate"] == "inf"
    assert set(doc["categories"]) == {"interactive", "long"}
    assert doc["categories"]["long"]["completed"] == 2
    assert doc["warmup"]["completed"] == 1 and len(doc["requests"]) == 10
    assert doc["client_cpu_s"] > 0
    assert "bench: 10/10 done, 0 failed" in proc.stderr  # the progress line
    for text in ("workload w3", "goodput:", "TTFT", "TPOT", "ITL", "E2E", "interactive", "long", "client CPU"):
        assert text in proc.stdout


def test_extra_body_reaches_every_request(server, capsys):
    """For a peer without `ignore_eos` (llama-cpp-python): ban its EOS through logit_bias."""
    seen = []

    def script(n, payload):
        seen.append(payload)
        return Script(0.001, (0.001,) * (payload["max_tokens"] - 1))

    server.reset(script)
    code, _, err = run_main(
        capsys,
        "--url",
        server.url,
        "--workload",
        "random",
        "--concurrency",
        "2",
        "--num-requests",
        "3",
        "--warmup",
        "1",
        "--no-progress",
        "--extra-body",
        '{"logit_bias": {"2": -100}, "ignore_eos": false}',
    )
    assert code == 0, err
    assert len(seen) == 4
    for payload in seen:
        assert payload["logit_bias"] == {"2": -100} and payload["ignore_eos"] is False
        assert payload["stream"] is True and len(payload["prompt"]) == 128


def test_text_prompts_for_servers_without_token_ids(server, capsys, tmp_path):
    """--prompt-format text sends the text of each prompt's ids; the lengths reported are those
    of the text re-encoded, which is what the server sees."""
    from splitserve.platform.tokenizer import load_tokenizer

    seen = []

    def script(n, payload):
        seen.append(payload)
        return Script(0.001, (0.001,) * (payload["max_tokens"] - 1))

    server.reset(script)
    out = tmp_path / "r.json"
    code, _, err = run_main(
        capsys,
        "--url",
        server.url,
        "--workload",
        "random",
        "--concurrency",
        "2",
        "--num-requests",
        "3",
        "--no-progress",
        "--prompt-format",
        "text",
        "--model",
        "served-name",
        "--tokenizer",
        "smollm2-135m",
        "--output",
        str(out),
    )
    assert code == 0, err
    tok = load_tokenizer("smollm2-135m")
    ids = [r.prompt_token_ids for r in workloads.build("random", num_requests=3).sessions for r in r]
    assert sorted(p["prompt"] for p in seen) == sorted(tok.decode(list(i)) for i in ids)  # any arrival order
    doc = json.loads(out.read_text())
    assert doc["config"]["prompt_format"] == "text"
    assert sorted(r["prompt_tokens"] for r in doc["requests"]) == sorted(
        len(tok.encode(p["prompt"], add_special_tokens=False)) for p in seen
    )
    assert all(abs(r["prompt_tokens"] - 128) <= 16 for r in doc["requests"])  # the round trip changes a few


def test_w2_reports_ttft_per_turn(server, capsys):
    def scenario():
        # the scripted TTFT grows with the prompt (30 ms per 32 tokens), so with the turn
        server.reset(lambda n, p: Script(0.03 * len(p["prompt"]) / 32, (0.002,) * (p["max_tokens"] - 1)))
        code, out, err = run_main(
            capsys,
            "--url",
            server.url,
            "--workload",
            "w2",
            "--concurrency",
            "2",
            "--num-requests",
            "8",
            "--no-progress",
            "--workload-param",
            "turns=4",
            "--workload-param",
            "think_s=0",
            "--workload-param",
            "output_len=4",
        )
        assert code == 0, err
        assert err == ""
        rows = [line.split() for line in out.splitlines() if line.startswith("turn-")]
        assert [r[0] for r in rows] == ["turn-1", "turn-2", "turn-3", "turn-4"] and all(r[1] == "2" for r in rows)
        ttft_p50 = [float(r[2]) for r in rows]
        assert ttft_p50 == pytest.approx([150, 210, 270, 330], abs=30)  # (128 + 64(k-1) + 32) / 32 * 30 ms

    retry_timing(scenario)


def test_no_successful_request_exits_1(capsys):
    code, out, err = run_main(
        capsys,
        "--url",
        "http://127.0.0.1:9",
        "--workload",
        "random",
        "--concurrency",
        "1",
        "--num-requests",
        "2",
        "--no-progress",
    )
    assert code == 1
    assert "all 2 requests failed; first: request 0: ConnectError" in err
