"""The model's whole CUDA path on a CPU: TritonOps (per-layer Triton kernels and the Triton paged
attention, split-context decode included) under TRITON_INTERPRET, driven by the engine, with
decode steps through the CUDA-graph buckets' static buffers (eager replay, padded rows).

A random `tiny` Llama in float32 (two layers: the interpreter is slow), its matrices redrawn
wider (std 0.15) so that the tokens depend on attention and rotary rather than echoing the
input; the reference is the same weights on the torch path. Greedy tokens must be equal.
"""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

pytest.importorskip("triton")

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig  # noqa: E402
from splitserve.platform.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.platform.kernels.triton_ops import TritonOps  # noqa: E402
from splitserve.platform.sampling.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU test of the CUDA path's logic; on a GPU the device script runs it for real"
)

CONFIG = EngineConfig(
    model="random:tiny",
    device=DeviceConfig(quantization="none"),
    cache=CacheConfig(kv_cache_memory_bytes=8 * 1024**2),
    scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256),
)
PROMPTS = [[5 + i for i in range(n)] for n in (3, 17, 40)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_triton_ops_and_graph_buffers_give_the_torch_paths_tokens():
    reference = LLMEngine(CONFIG)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    expected = [o.output_token_ids for o in reference.generate(PROMPTS, GREEDY)]

    model = copy.deepcopy(reference.model)
    model.use_fused_ops(TritonOps())
    engine = LLMEngine(CONFIG, model=model)
    graphs = engine.runner.enable_decode_graphs(4, engine.max_model_len, capture=False)
    graphs.num_splits = {n: 3 for n in graphs.sizes}  # the split kernel and its reduce
    buckets = []
    run = graphs.run
    graphs.run = lambda seqs: buckets.append(len(seqs)) or run(seqs)
    got = [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert len({t for out in expected for t in out}) > 6, f"the reference echoes its input: {expected}"
    assert 3 in buckets, "the three decodes ran padded to bucket 4 through the static buffers"
