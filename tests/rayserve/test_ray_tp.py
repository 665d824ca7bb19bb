"""A tensor-parallel replica on Ray, served end to end on the CPU: `splitserve serve --backend ray`
with a TP 1 prefill pool and a TP 2 decode pool on a local Ray.

The decode replica reserves two bundles (STRICT_PACK) and starts its rank 1 itself; the official
`openai` client's greedy completion equals the one-process engine's on the same weights (a tiny
random Llama checkpoint written by transformers: 4 heads and 2 KV heads split over 2 ranks, where
the default model's 9 heads do not), and its prompt's KV came from the prefill replica: P/D from
TP 1 to TP 2 through Ray.
"""

import dataclasses

import openai
import psutil
import pytest
from family_folders import save_family
from raykit import start_local_serve, wait_for

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_gguf_path) -> str:
    folder = tmp_path_factory.mktemp("ray-tp-llama")
    save_family(folder, "llama", smollm2_gguf_path, {"llama": ("LlamaConfig", "LlamaForCausalLM", {})})
    return str(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama):
    def tp2_decode(config):
        return dataclasses.replace(
            config,
            model=tiny_llama,
            ray=dataclasses.replace(config.ray, num_cpus=4),  # bundles of 1 CPU per rank, and the prefill pool
            engine=config.engine.replace(quantization="none"),
            decode=dataclasses.replace(config.decode, max_replicas=1, tensor_parallel_size=2),
        )

    app = start_local_serve(tmp_path_factory, adjust=tp2_decode)
    yield app
    app.stop()


def rank_processes_since(started_at: float) -> list[psutil.Process]:
    """Rank processes a Ray actor started since `started_at` (not those of the tests another
    xdist worker runs beside this one: their parent is a pytest process)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "splitserve.platform.parallel.rank" in cmdline and proc.info["create_time"] >= started_at - 1:
            try:
                parent = " ".join(proc.parent().cmdline())
            except (psutil.NoSuchProcess, AttributeError):
                continue
            if "ray" in parent and "pytest" not in parent:
                found.append(proc)
    return found


def test_a_tp2_decode_replica_serves_the_engines_greedy_answer_with_kv_from_prefill(served, tiny_llama):
    from splitserve.platform.config import DeviceConfig, EngineConfig
    from splitserve.platform.engine.llm_engine import LLMEngine
    from splitserve.platform.sampling.params import SamplingParams

    client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)
    assert len(rank_processes_since(served.started_at)) == 1  # the decode replica's rank 1
    [decode] = [w for w in served.workers() if w["role"] == "decode"]
    out = client.completions.create(model=tiny_llama, prompt=PROMPT, max_tokens=8, temperature=0)
    engine = LLMEngine(EngineConfig(model=tiny_llama, device=DeviceConfig(dtype="float32", quantization="none")))
    [ref] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == len(ref.output_token_ids)
    metrics = wait_for(lambda: _metrics(decode), 10, "the decode replica's metrics")
    assert 'splitserve_remote_prefills_total{outcome="ok"} 1.0' in metrics


def _metrics(worker: dict) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://{worker['metrics']}/metrics", timeout=10).read().decode()
