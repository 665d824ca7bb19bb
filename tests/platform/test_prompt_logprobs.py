"""Prompt logprobs (echo / prompt_logprobs) through the engine, against transformers on the same
SmolLM2 weights: every prompt token's logprob and its top-k, through chunked prefill, a warm
prefix cache (which such a request must not reuse), logit slicing and preemption."""

import pytest
import torch

from splitserve.platform.engine import prompt_logprobs as prompt_lp
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = (
    "Question: Which gas do plants take in from the air to make sugar? Answer: carbon dioxide, "
    "which they turn into glucose using light from the sun and water from the soil."
)


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position (row p predicts token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def check(out, ids, ref, k):
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == ids[p]
        assert entry.logprob == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-3)
        assert len(entry.top) == k
        top_ref = ref[p - 1].topk(k)
        for (tid, lp), ref_lp in zip(entry.top, top_ref.values.tolist()):
            assert lp == pytest.approx(ref_lp, abs=1e-3)
            assert float(ref[p - 1, tid]) == pytest.approx(lp, abs=1e-3)  # the id carries that logprob


def test_prompt_logprobs_match_transformers_through_chunks_and_a_warm_prefix_cache(
    make_engine, hf_smollm2, monkeypatch
):
    hf_model, _ = hf_smollm2
    engine = make_engine(max_num_batched_tokens=16)  # the prompt spans several chunks
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 32
    ref = reference(hf_model, ids)
    # Warm the prefix cache with the same prompt: a prompt-logprobs request must still score it all.
    plain = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None
    again = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.num_cached_tokens > 0
    monkeypatch.setattr(prompt_lp, "SLICE_ROWS", 5)  # slices inside each 16-token chunk
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0
    check(out, ids, ref, 3)
    assert out.output_token_ids[0] == int(ref[-1].argmax())
    engine.pool.check_invariants()


def test_prompt_logprobs_alone_and_beside_other_requests(make_engine, hf_smollm2):
    """Batched with plain requests (decodes first in the step), k = 0 (the chosen token only), and
    the list arrives once, on the first output of a streamed request."""
    hf_model, _ = hf_smollm2
    engine = make_engine()
    ids = engine.tokenizer.encode(PROMPT)
    ref = reference(hf_model, ids)
    engine.add_request(
        prompt_token_ids=engine.tokenizer.encode("Once upon a time"),
        params=SamplingParams(temperature=0, max_tokens=8),
        req_id="plain",
    )
    engine.step()  # "plain" decodes in the next steps beside the scored prompt
    engine.add_request(
        prompt_token_ids=ids,
        params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0),
        req_id="scored",
    )
    firsts = []
    while engine.has_unfinished_requests():
        firsts += [o for o in engine.step() if o.req_id == "scored"]
    assert [o.prompt_logprobs is not None for o in firsts] == [True, False, False]
    check(firsts[0], ids, ref, 0)


def test_prompt_logprobs_survive_preemption(make_engine, hf_smollm2):
    """A tight pool preempts; the scored request's list (on its first output) is still whole."""
    hf_model, _ = hf_smollm2
    engine = make_engine(num_blocks=8, max_model_len=128, max_num_batched_tokens=32)
    ids = engine.tokenizer.encode(PROMPT)[:40]
    ref = reference(hf_model, ids)
    engine.add_request(prompt_token_ids=ids[:30], params=SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.add_request(
        prompt_token_ids=ids,
        req_id="scored",
        params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1),
    )
    scored = []
    while engine.has_unfinished_requests():
        scored += [o for o in engine.step() if o.req_id == "scored"]
    assert engine.scheduler.stats.num_preemptions > 0
    assert sum(o.prompt_logprobs is not None for o in scored) == 1
    check(scored[0], ids, ref, 1)


def test_prompt_logprobs_bounds_and_no_remote_prefill(make_engine):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        engine.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(prompt_logprobs=1), remote_prefill=True)


def test_prompt_logprobs_through_a_lora_adapter_match_peft(make_engine, hf_smollm2, tmp_path):
    """A LoRA request scores its prompt through its adapter: transformers + PEFT's numbers."""
    from lora_fixtures import make_peft_adapters

    name = "qv-down-r16"
    peft_model, _ = make_peft_adapters(*hf_smollm2, tmp_path, names=(name,), std=0.05)
    engine = make_engine()
    engine.load_lora_adapter(name, str(tmp_path / name))
    ids = engine.tokenizer.encode(PROMPT)[:24]
    peft_model.set_adapter(name)
    ref = reference(peft_model, ids)
    base = reference(hf_smollm2[0], ids)
    assert float((ref - base).abs().max()) > 0.01  # the adapter changes the numbers
    engine.add_request(
        prompt_token_ids=ids,
        params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
        req_id="lora",
        lora_name=name,
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    check(outs[0], ids, ref, 2)
