"""The `splitserve` command as a user runs it: only generated text on stdout, clear errors."""

import json
import pathlib
import subprocess
import sys

import pytest

CLI = str(pathlib.Path(sys.executable).parent / "splitserve")


def run(*args, stdin=None):
    return subprocess.run([CLI, *args], capture_output=True, text=True, input=stdin, timeout=300)


@pytest.mark.slow
def test_generate_prints_only_the_text():
    proc = run("generate", "--model", "smollm2-135m", "--max-tokens", "4", "--threads", "1", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == " Paris.\n\n\n"  # greedy: " Paris", ".", "\n", "\n" then the CLI's newline


@pytest.mark.slow
def test_chat_reads_turns_from_stdin():
    proc = run(
        "chat",
        "--model",
        "smollm2-135m",
        "--max-tokens",
        "16",
        "--threads",
        "1",
        stdin="What is the capital of France?\n\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--temperature", "-1", "hi"], "temperature=-1.0 is invalid"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens=0 is invalid"),
        (["generate", "--model", "nope", "hi"], "unknown model 'nope'"),
        (["generate", "--model", "random:huge", "hi"], "unknown random preset 'huge'; allowed: tiny"),
        (
            ["generate", "--quantization", "q4_k_m", "hi"],
            "invalid choice: 'q4_k_m' (choose from 'none', 'auto', 'int4', 'w4a16', 'w4a8', 'int8', 'fp16')",
        ),
        (
            ["worker", "--quantization", "gptq"],
            "invalid choice: 'gptq' (choose from 'none', 'auto', 'int4', 'w4a16', 'w4a8', 'int8', 'fp16')",
        ),
        (
            ["up", "--quantization", "awq"],
            "invalid choice: 'awq' (choose from 'none', 'auto', 'int4', 'w4a16', 'w4a8', 'int8', 'fp16')",
        ),
        (["up", "--decode-threads", "0"], "argument --decode-threads: 0 is too small; allowed: an integer >= 1"),
        (
            ["generate", "--quantization", "int4", "--device", "cuda", "hi"],
            "quantization 'int4' runs on the CPU only; on cuda allowed: none, auto",
        ),
        (
            ["generate", "--model", "random:tiny", "-tp", "3", "hi"],
            "--tensor-parallel-size 3 does not divide the 4 attention heads of model 'random:tiny'; allowed: [1, 2, 4]",
        ),
        (["generate", "-tp", "0", "hi"], "tensor_parallel_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


def test_up_leaves_a_core_for_the_router_by_default():
    from splitserve.launch.up import role_threads

    assert role_threads(None, None, None, cores=2) == {"prefill": 1, "decode": 1}
    assert role_threads(None, None, None, cores=16) == {"prefill": 8, "decode": 15}
    assert role_threads(1, None, None, cores=2) == {"prefill": 1, "decode": 1}  # --threads sets both
    assert role_threads(1, None, 2, cores=2) == {"prefill": 1, "decode": 2}  # a role's flag wins


def test_unsupported_architecture_and_missing_tensor_exit_2_without_a_traceback(tmp_path, smollm2_gguf_path):
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    proc = run("generate", "--model", str(tmp_path / "falcon"), "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model_type 'falcon' is not supported; supported: llama, mistral, qwen2, qwen3" in proc.stderr

    folder = tmp_path / "qwen3"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    from splitserve.platform.tokenizer import Tokenizer

    Tokenizer.from_gguf(smollm2_gguf_path).save_tokenizer_json(str(folder / "tokenizer.json"))
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    proc = run("generate", "--model", str(folder), "--max-tokens", "1", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1 weight(s) missing, first: model.layers.1.self_attn.k_norm.weight" in proc.stderr


def test_each_command_loads_only_what_it_runs():
    """The gateway, the launcher and the small tools never import torch (the worker's engine):
    a router pod and `splitserve up`'s own process stay small and start in a fraction of a
    second. `splitserve --help` and an unknown command still list every command."""
    probe = (
        "import sys, json; from splitserve.platform.cli import build_parser; "
        "helps = [build_parser(json.loads(argv)).format_help() for argv in sys.argv[1:]]; "
        "print(json.dumps(['torch' in sys.modules, helps]))"
    )

    def load(*argvs):
        args = [json.dumps(argv) for argv in argvs]
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    light = (["router", "--port", "1"], ["--log-level", "INFO", "up"], ["usage"], ["trace"], ["epp"], ["sidecar"])
    torch_loaded, _ = load(*light)
    assert not torch_loaded, f"one of these command lines imports torch: {light}"
    torch_loaded, helps = load([], ["nope"])  # every command: the worker's loads torch (the probe sees it)
    assert torch_loaded
    for text in helps:
        assert all(name in text for name in ("worker", "router", "up", "epp", "usage", "envoy-config")), text


@pytest.mark.parametrize("command", ["router", "up"])
def test_keys_with_limits_on_several_gateway_processes_without_redis_exit_2(tmp_path, command):
    """A config that says several gateway processes serve these keys (gateway.num_processes, as the
    operator renders it) and no shared store: refused at start, before `up` starts any worker."""
    keys, config = tmp_path / "keys.yaml", tmp_path / "router.yaml"
    keys.write_text("keys:\n- {id: team-a, key: sk-a, rpm: 10}\n")
    config.write_text("gateway:\n  num_processes: 2\n")
    proc = run(command, "--config", str(config), "--api-keys-file", str(keys))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "2 gateway processes (gateway.num_processes) serve keys with rpm, tpm or monthly_tokens" in proc.stderr
    assert "Set gateway.rate_limit_redis_url (splitserve router --redis-url" in proc.stderr
    assert "starting 1 prefill" not in proc.stderr
