"""A tensor-parallel group over two nodes, both on this host (loopback): rank 0 in this process
(the leader, node 0), rank 1 run by the real `splitserve worker --nnodes 2 --node-rank 1` agent
(platform/parallel/node.py). The group gives TP 1's greedy tokens; the agent ends cleanly when the
leader stops; a killed agent takes the group down with a clean error and leaves no rank behind;
a leader whose other node never comes fails at start with an error that says so.

The model is test_tensor_parallel's tiny random Llama (4 heads, 2 KV heads), fp32.
"""

import signal
import subprocess
import sys
import time

import psutil
import pytest
from ports import free_port
from test_model_families import save_family
from test_tensor_parallel import GREEDY, PROMPTS, TP_FAMILIES, engine, tokens
from workerproc import rank_processes

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError, TensorParallelError
from splitserve.platform.parallel import executor


@pytest.fixture(scope="module")
def llama(tmp_path_factory, smollm2_gguf_path) -> str:
    folder = tmp_path_factory.mktemp("tp-nodes-llama")
    save_family(folder, "llama", smollm2_gguf_path, TP_FAMILIES)
    return str(folder)


def two_nodes(model: str, port: int, node_rank: int = 0) -> EngineConfig:
    return EngineConfig(
        model=model,
        cache=CacheConfig(num_blocks=96),
        device=DeviceConfig(dtype="float32", quantization="none", num_threads=1),
        parallel=ParallelConfig(
            tensor_parallel_size=2, nnodes=2, node_rank=node_rank, master_addr="127.0.0.1", master_port=port
        ),
    )


def start_agent(model: str, port: int) -> subprocess.Popen:
    """Node 1's agent, through the worker's own command line."""
    argv = [sys.executable, "-m", "splitserve.platform.cli", "worker", "--model", model, "--dtype", "float32"]
    argv += ["--quantization", "none", "--threads", "1", "-tp", "2", "--nnodes", "2"]
    argv += ["--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.Popen(argv)


def agent_ranks(agent: subprocess.Popen) -> list:
    return rank_processes(psutil.Process(agent.pid))


def gone_within(procs: list, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
            return True
        time.sleep(0.2)
    return False


def test_two_nodes_give_tp1_tokens_and_the_agent_ends_with_the_leader(llama):
    reference = tokens(engine(llama, 1), PROMPTS)
    port = free_port()
    agent = start_agent(llama, port)
    try:
        leader = LLMEngine(two_nodes(llama, port))
        ranks = agent_ranks(agent)
        assert len(ranks) == 1 and leader.executor.pids == []  # rank 1 runs on node 1, under its agent
        assert tokens(leader, PROMPTS) == reference
        leader.close()
        assert agent.wait(30) == 0
        assert gone_within(ranks, 10)
    finally:
        agent.kill()


def test_a_killed_agent_takes_the_group_down_and_leaves_no_rank(llama):
    port = free_port()
    agent = start_agent(llama, port)
    leader = None
    try:
        leader = LLMEngine(two_nodes(llama, port))
        assert tokens(leader, PROMPTS[:1]) is not None
        ranks = agent_ranks(agent)
        agent.send_signal(signal.SIGKILL)
        assert gone_within(ranks, 10), "node 1's rank outlived its agent"
        deadline = time.monotonic() + 30
        with pytest.raises(TensorParallelError, match="node 1"):
            while time.monotonic() < deadline:
                leader.executor.check()
                time.sleep(0.2)
    finally:
        agent.kill()
        if leader is not None:
            leader.close()


def test_the_agent_exits_non_zero_when_the_leader_takes_the_group_down(llama):
    port = free_port()
    agent = start_agent(llama, port)
    try:
        leader = LLMEngine(two_nodes(llama, port))
        ranks = agent_ranks(agent)
        leader.executor.fail("taken down by the test")
        assert agent.wait(30) == 1
        assert gone_within(ranks, 10)
        with pytest.raises(TensorParallelError, match="taken down by the test"):
            leader.generate([PROMPTS[0]], GREEDY)
        leader.close()
    finally:
        agent.kill()


def test_a_leader_whose_other_node_never_comes_fails_at_start(llama, monkeypatch):
    monkeypatch.setattr(executor, "START_TIMEOUT_S", 2.0)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="1 of the group's other nodes did not connect within 2 s"):
        LLMEngine(two_nodes(llama, free_port()))
    assert time.monotonic() - t0 < 10
    assert not rank_processes(psutil.Process())
