"""The device check's Python parts on a CPU (bench/gpu_check.py, bench/gpu_check_pd.py).

The GPU run is one call on a lent machine; these make sure that call does not die on its own
script: the P/D phase end to end with `random:tiny` workers (the auto path resolves to tcp on a
CPU and says so), its summaries and acceptance arithmetic, the graph-memory figures, n-gram
speculation at batch 1 and the fp32 prefill phase on tiny engines.
"""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check_pd = _load("gpu_check_pd")
gpu_check = _load("gpu_check")


def row(ttft, prefill=0.0, exposed=0.0, tokens=(1, 2)):
    return dict(
        ttft=ttft,
        queue=0.001,
        prefill=prefill,
        exposed_transfer=exposed,
        first_decode_step=0.01,
        tokens=list(tokens),
        path="-",
    )


def test_summaries_give_ratios_to_the_cold_colocated_arm_and_token_equality():
    rows = {
        "pd_ipc": [row(0.11, 0.1, 0.005), row(0.12, 0.1, 0.007)],
        "pd_tcp": [row(0.2, 0.1, 0.05), row(0.2, 0.1, 0.05, tokens=(9, 9))],
        "colocated": [row(0.1), row(0.1)],
    }
    for r in rows["pd_ipc"]:
        r["path"] = "cuda_ipc"
    s = gpu_check_pd.summarize(rows)
    assert s["pd_ipc"]["ttft_over_colocated"] == pytest.approx(1.15)
    assert s["pd_ipc"]["exposed_share_of_prefill"] == pytest.approx(0.06)
    assert s["pd_ipc"]["paths"] == ["cuda_ipc"] and s["pd_tcp"]["tokens_equal_colocated"] == "1/2"
    results = {"llama-3.2-1b bf16": {"prompt_1024": s, "prompt_8192": s}, "llama-3.2-1b fp32": {"prompt_1024": s}}
    acc = gpu_check_pd.acceptance(results)
    assert acc["ipc_8k_bf16_ratio"] == pytest.approx(1.15) and acc["tcp_8k_bf16_ratio"] == pytest.approx(2.0)
    assert acc["fp32_tokens_equal"] == {"llama-3.2-1b fp32 1024 pd_ipc": "2/2", "llama-3.2-1b fp32 1024 pd_tcp": "1/2"}
    assert not acc["fp32_gate_ok"] and not acc["ok"]


def test_graph_memory_is_what_mem_get_info_saw_and_never_negative():
    graphs = types.SimpleNamespace(captured_bytes=3 << 30, free_bytes_around_capture=(70 << 30, 67 << 30))
    assert gpu_check.graph_memory(graphs)["ok"]
    graphs.captured_bytes = -1
    assert not gpu_check.graph_memory(graphs)["ok"]
    assert gpu_check.graph_memory(None) == "no graphs captured on this device"


def test_speculation_at_batch_1_and_the_fp32_prefill_phase_run_on_tiny_engines():
    from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from splitserve.platform.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model="random:tiny",
            device=DeviceConfig(dtype="float32", quantization="none"),
            cache=CacheConfig(kv_cache_memory_bytes=2**25),
            scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=256),
        )
    )
    spec = gpu_check.speculative_b1(engine, random.Random(0), max_tokens=16, num_prompts=2)
    assert spec["greedy_equal"] == "2/2"  # fp32 on a CPU: verification changes no token
    assert spec["plain_tok_s"] > 0 and spec["ngram_tok_s"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert engine.speculator is None  # the engine is given back as it was
    fp32 = gpu_check.fp32_prefill(smoke=True)
    assert fp32["ieee"]["seconds"] > 0 and fp32["tf32"]["seconds"] > 0 and fp32["tokens"] == 256


def test_the_pd_phase_runs_end_to_end_with_tiny_workers_on_a_cpu():
    result = gpu_check_pd.pd(smoke=True)
    tiny = result["tiny fp32"]
    assert "error" not in tiny, tiny
    for n in (256, 1024):
        arms = tiny[f"prompt_{n}"]
        assert arms["pd_ipc"]["tokens_equal_colocated"] == "2/2" and arms["pd_tcp"]["tokens_equal_colocated"] == "2/2"
        assert arms["pd_ipc"]["paths"] == ["bytes"]  # a CPU has no CUDA IPC
    notes = " ".join(tiny["notes"]["D"])
    assert "KV path: tcp" in notes and "not on a CUDA device" in notes
