"""The sampler's device path (sampling/device_sampler.py) against the CPU sampler.

The device path runs here on CPU tensors (Sampler.on_device): same logits, same seeds, so the
tokens, logprobs and top-n lists must be equal to the CPU path's for every kind of row: greedy,
temperature only, top-k (with ties at the k-th), top-p (flat rows that make the CPU path grow
its short list past 32 and 256), min-p, all three together, penalties and min_tokens, logprobs,
seeded and unseeded rows in one batch. On a GPU the same test runs with CUDA logits, and the
device path must not synchronise before its one copy back (torch's sync debug mode).
"""

import pytest
import torch

from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.sampler import Sampler, SamplingRow, make_generator

VOCAB = 4096
P = SamplingParams
ROWS = [
    P(temperature=0),
    P(temperature=0.7, seed=1),
    P(temperature=1.0, top_k=5, seed=2),
    P(temperature=1.0, top_k=3, seed=3),  # row 3 has ties at its 3rd logit
    P(temperature=1.3, top_p=0.9, seed=4),
    P(temperature=2.0, top_p=0.995, seed=5),  # flat row: the CPU list grows twice
    P(temperature=0.9, min_p=0.05, seed=6),
    P(temperature=0.8, top_k=50, top_p=0.8, min_p=0.02, seed=7),
    P(temperature=1.0, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, seed=8),
    P(temperature=1.0, logprobs=3, seed=9),
    P(temperature=0, logprobs=0, min_tokens=4, stop_token_ids=[11]),
    P(temperature=0.6, top_k=20),  # unseeded: the global RNG
]


def _logits(step: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    logits = torch.randn(len(ROWS), VOCAB, generator=gen) * 3
    logits[3, [40, 41, 42, 43]] = logits[3].max() + 1  # a four-way tie at the top of a top-k 3 row
    logits[5] *= 0.01  # nearly uniform
    logits[10, 11] = 50.0  # a stop token min_tokens must block
    return logits.to(device)


def _run(sampler: Sampler, device) -> list:
    torch.manual_seed(1234)
    rows = [SamplingRow(p, [3, 5, 7, 3], [9, 9, 21], make_generator(p.seed)) for p in ROWS]
    outs = []
    for step in range(4):
        out = sampler(_logits(step, device), rows, eos_token_ids={2})
        outs.append((out.token_ids, out.logprobs, out.top_logprobs))
        for row, token in zip(rows, out.token_ids):
            row.output_token_ids = [*row.output_token_ids, token]
    return outs


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_device_path_draws_the_cpu_paths_tokens(device):
    expected = _run(Sampler(), "cpu")
    device_sampler = Sampler()
    device_sampler.on_device = True
    got = _run(device_sampler, device)
    assert [o[0] for o in got] == [o[0] for o in expected]
    for (_, lp, top), (_, lp_ref, top_ref) in zip(got, expected):
        assert lp == pytest.approx(lp_ref, rel=1e-5) and top[9] is not None and len(top[9]) == 3
        assert [t and [i for i, _ in t] for t in top] == [t and [i for i, _ in t] for t in top_ref]
    tokens = [o[0] for o in expected]
    # three outputs so far: min_tokens 4 blocks the stop token at step 0 only
    assert tokens[0][10] != 11 and tokens[1][10] == 11
    assert len({step[5] for step in tokens}) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: checks device synchronisation")
def test_device_path_synchronises_only_for_its_one_copy():
    from splitserve.platform.sampling import device_sampler

    rows = [SamplingRow(p, [3, 5], [9], make_generator(p.seed)) for p in ROWS if not p.min_tokens]
    logits = _logits(0, "cuda")[: len(rows)]
    uniforms = torch.rand(len(rows))
    packed = device_sampler.pack_params(rows, uniforms, logits.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids = device_sampler.pick_tokens(logits, packed, any_truncated=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert token_ids.shape == (len(rows),)
