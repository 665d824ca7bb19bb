"""The one SamplingParams <-> wire mapping the router and the workers share."""

import dataclasses

import pytest

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.constraints import StructuredSpec
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import sampling
from splitserve.platform.wire import worker_pb2 as pb


def test_every_field_round_trips():
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=123,
        max_tokens=77,
        min_tokens=3,
        stop=("END", "\n\n"),
        stop_token_ids=(2, 7),
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=4,
        skip_special_tokens=False,
        structured=StructuredSpec("regex", "[a-z]+"),
        logit_bias={5: -100, 9: 2.5},
        prompt_logprobs=3,
        embed=True,
    )
    back = sampling.from_proto(sampling.to_proto(params))
    assert back == params
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(sampling.OPTIONAL_FIELDS) | {
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "structured",
        "logit_bias",
        "embed",
    }


def test_unset_fields_take_the_defaults_and_bad_values_are_rejected():
    assert sampling.from_proto(pb.SamplingParams()) == SamplingParams()
    with pytest.raises(InvalidRequestError, match="top_k=-5 is invalid"):
        sampling.from_proto(pb.SamplingParams(top_k=-5))
