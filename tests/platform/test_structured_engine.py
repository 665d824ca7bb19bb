"""Constrained decoding and logit_bias in the engine, with the real SmolLM2 model and llguidance.

Covers the engine acceptance points of issue 14 that need no servers: outputs that parse and
validate for greedy and sampled rows in one batch, EOS only where the grammar may end (and a
terminated grammar finishing with "stop"), regex/choice, logit_bias, resume (a fresh matcher
replaying already generated tokens), chunked prefill and prefix-cache hits giving the same
constrained output, and the compile timeout / bad grammar errors.
"""

import json
import re
import threading

import jsonschema
import pytest

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.structured import GrammarBackend, StructuredSpec

PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def json_spec(schema):
    return StructuredSpec("json", json.dumps(schema))


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def finish(engine, prompt, params_list):
    return engine.generate([prompt] * len(params_list), params_list)


def test_json_schema_greedy_and_sampled_in_one_batch(engine):
    spec = json_spec(PERSON)
    params = [SamplingParams(temperature=0, max_tokens=120, structured=spec)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured=spec) for s in range(3)
    ]
    for out in finish(engine, PROMPT, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_regex_and_choice_hold_and_eos_only_at_the_end(engine):
    regex = StructuredSpec("regex", r"[0-9]{3}-[a-z]{2,4}")
    choice = StructuredSpec("choice", json.dumps(["positive", "negative", "neutral"]))
    outs = finish(
        engine,
        PROMPT,
        [
            SamplingParams(temperature=0, max_tokens=30, structured=regex),
            SamplingParams(temperature=1.5, seed=7, max_tokens=30, structured=regex),
            SamplingParams(temperature=0, max_tokens=30, structured=choice),
            SamplingParams(temperature=2.0, seed=3, max_tokens=30, structured=choice),
        ],
    )
    for out in outs[:2]:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text) and out.finish_reason == "stop", out.text
    for out in outs[2:]:
        assert out.text in ("positive", "negative", "neutral") and out.finish_reason == "stop", out.text


def test_unconstrained_rows_in_the_same_batch_are_unchanged(engine):
    plain = SamplingParams(temperature=0, max_tokens=8)
    alone = finish(engine, PROMPT, [plain])[0]
    mixed = finish(
        engine, PROMPT, [plain, SamplingParams(temperature=0, max_tokens=8, structured=StructuredSpec("json_object"))]
    )
    assert mixed[0].output_token_ids == alone.output_token_ids
    assert mixed[1].text.startswith("{")


def test_logit_bias_minus_100_on_the_greedy_token_changes_it_and_plus_100_forces(engine):
    base = finish(engine, PROMPT, [SamplingParams(temperature=0, max_tokens=1)])[0].output_token_ids[0]
    banned = finish(engine, PROMPT, [SamplingParams(temperature=0, max_tokens=1, logit_bias={base: -100})])[0]
    assert banned.output_token_ids[0] != base
    forced = finish(engine, PROMPT, [SamplingParams(temperature=0, max_tokens=3, logit_bias={"42": 100})])[0]
    assert forced.output_token_ids == [42, 42, 42]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request(PROMPT, SamplingParams(logit_bias={10**6: 1}))
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
    assert not engine.has_unfinished_requests()


def test_resume_replays_tokens_into_a_fresh_matcher(engine):
    params = SamplingParams(temperature=0, max_tokens=120, structured=json_spec(PERSON))
    whole = finish(engine, PROMPT, [params])[0]
    cut = len(whole.output_token_ids) // 2
    engine.add_request(PROMPT, params, req_id="resumed", resume_output_token_ids=whole.output_token_ids[:cut])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].output_token_ids == whole.output_token_ids and outs[0].finish_reason == "stop"
    bad = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="constraint"):
        engine.add_request(PROMPT, params, resume_output_token_ids=bad)


def test_chunked_prefill_and_prefix_hits_give_the_same_constrained_output(make_engine, engine):
    long_prompt = PROMPT.replace("Describe a person", "Describe a person. " + "Be brief. " * 25 + "Now")
    params = SamplingParams(temperature=0, max_tokens=60, structured=json_spec(PERSON))
    reference = finish(engine, long_prompt, [params])[0]
    again = finish(engine, long_prompt, [params])[0]  # second run: prefix-cache hit
    assert again.num_cached_tokens > 0 and again.output_token_ids == reference.output_token_ids
    chunked = make_engine(enable_prefix_caching=False, max_num_batched_tokens=64, enable_chunked_prefill=True)
    assert finish(chunked, long_prompt, [params])[0].output_token_ids == reference.output_token_ids


def test_bad_grammars_are_clear_errors_and_the_engine_keeps_serving(engine):
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredSpec("json", "{nope")
    with pytest.raises(InvalidRequestError, match="unknown"):
        StructuredSpec("xml", "<a/>")
    with pytest.raises(InvalidRequestError, match="does not compile"):
        engine.add_request(PROMPT, SamplingParams(structured=StructuredSpec("regex", "([a-")))
    with pytest.raises(InvalidRequestError, match="does not compile"):
        engine.add_request(PROMPT, SamplingParams(structured=json_spec({"type": "nosuchtype"})))
    assert json.loads(
        finish(engine, PROMPT, [SamplingParams(temperature=0, max_tokens=100, structured=json_spec(PERSON))])[0].text
    )


def test_compile_timeout_refuses_at_once_and_is_remembered(engine):
    backend = GrammarBackend(engine.tokenizer, compile_timeout_s=0.05)
    release = threading.Event()
    backend._compile_now = lambda spec, tok: release.wait(60)  # a compile that hangs (fault injection)
    spec = StructuredSpec("regex", "a+")
    with pytest.raises(InvalidRequestError, match="did not compile within"):
        backend.compile(spec)
    with pytest.raises(InvalidRequestError, match="did not compile within"):
        backend.compile(spec)  # refused at once, not compiled again
    release.set()
    backend.close()


def test_worker_metrics_export_compile_time_mask_time_and_kinds(engine):
    from prometheus_client.parser import text_string_to_metric_families

    from splitserve.workers.metrics import WorkerMetrics

    finish(
        engine,
        PROMPT,
        [SamplingParams(temperature=0, max_tokens=5, structured=StructuredSpec("regex", "[a-z]{1,3}[0-9]{2}"))],
    )
    metrics = WorkerMetrics("decode", "smollm2-135m")
    metrics.update_structured(engine.grammar_stats)
    samples = {
        (s.name, s.labels.get("kind")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("splitserve_grammar_compile_seconds_count", None)] >= 1
    assert samples[("splitserve_grammar_mask_rows_total", None)] >= 1
    assert samples[("splitserve_grammar_mask_seconds_total", None)] > 0
    assert samples[("splitserve_structured_requests_total", "regex")] >= 1
