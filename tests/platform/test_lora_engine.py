"""Multi-LoRA in the engine (platform/lora) against transformers + PEFT, on the real SmolLM2 weights.

Three random PEFT adapters (lora_A and lora_B seeded, non-zero; ranks 8 and 16; one rsLoRA;
different module sets, q and k included so a wrong q/k row order would show) run in one batch
with base requests. With `--quantization none` every request's greedy tokens equal those of
transformers + PEFT with that request's adapter; in the fast default mode (`auto`) an adapter's
logits meet the base model's fast-mode gates (tests/platform/test_quantization.py) against
`none`, and the mixed batch gives each request the tokens it gets alone.
"""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import ADAPTERS, make_peft_adapters, peft_greedy, run_mixed
from test_engine_vs_transformers import PROMPTS, prompt_logits
from test_quantization import MEAN_TOLERANCE, MIN_TOP1_AGREEMENT, TOP20_TOLERANCE, needs_kernels

from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# transformers + PEFT runs each of the 16 reference requests token by token through its hooks
# (about 80 % of this file's time at 32 tokens): 20 tokens keep the check and cost less
PEFT_GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
NAMES = list(ADAPTERS)


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory, hf_smollm2):
    folder = tmp_path_factory.mktemp("peft-adapters")
    model, tok = make_peft_adapters(*hf_smollm2, folder)
    return model, tok, {name: str(folder / name) for name in NAMES}


def lora_engine(make_engine, paths, quantization="none"):
    engine = make_engine(quantization=quantization)

    for name, path in paths.items():
        engine.load_lora_adapter(name, path)
    return engine


def test_mixed_batch_equals_transformers_peft_per_request(make_engine, peft_adapters):
    model, tok, paths = peft_adapters
    engine = lora_engine(make_engine, paths)
    prompts = [tok(p).input_ids for p in PROMPTS[:4]]
    # every prompt with the base model and each adapter: 16 requests, 4 adapters' worth of rows mixed
    requests = [(ids, lora) for ids in prompts for lora in (None, *NAMES)]
    outs = run_mixed(engine, requests, PEFT_GREEDY)
    for (ids, lora), out in zip(requests, outs):
        assert out == peft_greedy(model, lora, ids, PEFT_GREEDY.max_tokens), f"{lora} diverged on {tok.decode(ids)!r}"
    by_adapter = {lora: [o for (_, name), o in zip(requests, outs) if name == lora] for lora in (None, *NAMES)}
    for name in NAMES:  # the adapters are not no-ops: each changes what the model says
        assert by_adapter[name] != by_adapter[None], name


def test_max_loras_skips_a_request_without_a_slot_but_not_the_queue(make_engine, peft_adapters):
    model, tok, paths = peft_adapters
    engine = make_engine()
    engine.scheduler.max_loras = 1
    for name, path in paths.items():
        engine.load_lora_adapter(name, path)
    ids = tok(PROMPTS[0]).input_ids
    a = engine.add_request(params=GREEDY, prompt_token_ids=ids, lora_name=NAMES[0])
    b = engine.add_request(params=GREEDY, prompt_token_ids=ids, lora_name=NAMES[1])  # no slot: waits
    c = engine.add_request(params=GREEDY, prompt_token_ids=ids)  # base: admitted
    d = engine.add_request(params=GREEDY, prompt_token_ids=ids, lora_name=NAMES[0])  # same adapter: admitted
    engine.step()
    running = {r.req_id for r in engine.scheduler.running}
    assert running == {a, c, d} and [r.req_id for r in engine.scheduler.waiting] == [b]
    assert engine.load().running_loras == (NAMES[0],) and engine.load().waiting_loras == (NAMES[1],)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.req_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.stats.num_lora_waits >= 1
    assert final[b].output_token_ids == peft_greedy(model, NAMES[1], ids, GREEDY.max_tokens)


@needs_kernels
def test_auto_mode_adapter_logits_within_the_fast_mode_gates(smollm2_models, peft_adapters, make_engine):
    _, tok, paths = peft_adapters
    ref_engine, fast_engine = lora_engine(make_engine, paths), lora_engine(make_engine, paths, quantization="auto")
    for name in NAMES:
        worst_top, mean, agree, positions = 0.0, 0.0, 0, 0
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            ref = adapter_logits(ref_engine, name, ids)
            ours = adapter_logits(fast_engine, name, ids)
            error = (ours - ref).abs()
            worst_top = max(worst_top, error.gather(1, ref.topk(20, dim=-1).indices).max().item())
            mean += error.mean().item() / len(PROMPTS)
            agree += (ours.argmax(-1) == ref.argmax(-1)).sum().item()
            positions += len(ids)
        assert worst_top <= TOP20_TOLERANCE["auto"], f"{name}: max |dlogit| over the top 20 = {worst_top:.3f}"
        assert mean <= MEAN_TOLERANCE, f"{name}: mean |dlogit| = {mean:.3f}"
        assert agree / positions >= MIN_TOP1_AGREEMENT, f"{name}: top-1 agrees at {agree}/{positions}"


@needs_kernels
def test_auto_mode_mixed_batch_gives_each_request_its_tokens_alone(make_engine, peft_adapters, monkeypatch):
    """In the fast mode a request's tokens and logprob floats do not depend on its batch-mates
    (base rows and other adapters), and the decode steps that run every layer in one C call
    (kernels/cpu_decode.c) give the per-layer Python path's bits, adapters included."""
    _, tok, paths = peft_adapters
    engine = lora_engine(make_engine, paths, quantization="auto")
    plan = engine.model.decode_plan
    assert plan is not None
    with_adapters = []
    run_plan = plan.run  # the model is shared by the session's engines: monkeypatch restores it
    monkeypatch.setattr(
        plan, "run", lambda *a, lora=None: with_adapters.append(lora is not None) or run_plan(*a, lora=lora)
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = [tok(p).input_ids for p in PROMPTS[4:7]]
    requests = [(ids, lora) for ids in prompts for lora in (None, *NAMES)]

    def run(batch: list) -> list:
        ids = [engine.add_request(params=params, prompt_token_ids=t, lora_name=lora) for t, lora in batch]
        got = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.req_id] += list(zip(out.new_token_ids, out.new_logprobs or []))
        engine.pool.reset_prefix_cache()
        return list(got.values())

    alone = [run([r])[0] for r in requests]
    mixed = run(requests)
    assert with_adapters.count(True) >= 9 * (params.max_tokens - 1)  # the adapter requests' decode steps
    assert all(len(m) == params.max_tokens for m in mixed)
    assert mixed == alone  # the same tokens and the same logprob floats, not merely close ones
    monkeypatch.setattr(engine.model, "decode_plan", None)  # the per-layer Python path
    assert run(requests) == mixed


def adapter_logits(engine, name, ids) -> torch.Tensor:
    """All-position logits of one prompt through the engine's model with adapter `name` on all rows."""
    context = engine.runner.lora_context
    context.begin([len(ids)], [engine.loras.get(name)], "cpu")
    try:
        return prompt_logits(engine.model, ids)
    finally:
        context.end()
