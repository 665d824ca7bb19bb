"""The `splitserve` command as a user runs it: only generated text on stdout, clear errors."""

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
    assert proc.stdout == " Paris.\n\n\n"   # greedy: " Paris", ".", "\n", "\n" then the CLI's newline


@pytest.mark.slow
def test_chat_reads_turns_from_stdin():
    proc = run("chat", "--model", "smollm2-135m", "--max-tokens", "16", "--threads", "1",
               stdin="What is the capital of France?\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "--temperature", "-1", "hi"], "temperature=-1.0 is invalid"),
    (["generate", "--max-tokens", "0", "hi"], "max_tokens=0 is invalid"),
    (["generate", "--model", "nope", "hi"], "unknown model 'nope'"),
    (["generate", "--model", "random:huge", "hi"], "unknown random preset 'huge'; allowed: tiny"),
    (["generate", "--quantization", "q4_k_m", "hi"],
     "invalid choice: 'q4_k_m' (choose from 'none', 'auto', 'int4', 'w4a16', 'w4a8', 'int8', 'fp16')"),
    (["worker", "--quantization", "gptq"], "invalid choice: 'gptq' (choose from 'none', 'auto', 'int4', 'w4a16', 'w4a8', 'int8', 'fp16')"),
    (["up", "--quantization", "awq"], "invalid choice: 'awq' (choose from 'none', 'auto', 'int4', 'w4a16', 'w4a8', 'int8', 'fp16')"),
    (["up", "--decode-threads", "0"], "argument --decode-threads: 0 is too small; allowed: an integer >= 1"),
    (["generate", "--quantization", "int4", "--device", "cuda", "hi"],
     "quantization 'int4' runs on the CPU only; on cuda allowed: none, auto"),
])
def test_bad_arguments_exit_2_with_a_message(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


def test_up_leaves_a_core_for_the_router_by_default():
    from splitserve.router.up import role_threads

    assert role_threads(None, None, None, cores=2) == {"prefill": 1, "decode": 1}
    assert role_threads(None, None, None, cores=16) == {"prefill": 8, "decode": 15}
    assert role_threads(1, None, None, cores=2) == {"prefill": 1, "decode": 1}     # --threads sets both
    assert role_threads(1, None, 2, cores=2) == {"prefill": 1, "decode": 2}        # a role's flag wins
