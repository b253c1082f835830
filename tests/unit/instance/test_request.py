"""SamplingParams.validate names the bad field; Request slices its context without copying it."""

import pytest

from services.common.errors import InvalidArgument
from services.instance.engine.request import Request, RequestId, SamplingParams
from services.instance.engine.text_output import TextOutput

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(("params", "num_prompt_tokens", "field"), [
    (SamplingParams(), 0, "prompt_token_ids"),
    (SamplingParams(), 101, "max_model_len"),
    (SamplingParams(max_tokens=0), 5, "max_tokens"),
    (SamplingParams(temperature=-0.1), 5, "temperature"),
    (SamplingParams(top_p=0.0), 5, "top_p"),
    (SamplingParams(top_p=1.01), 5, "top_p"),
    (SamplingParams(top_k=-1), 5, "top_k"),
    (SamplingParams(logprobs=-1), 5, "logprobs"),
    (SamplingParams(logprobs=21), 5, "logprobs"),
    (SamplingParams(seed=-1), 5, "seed"),
    (SamplingParams(seed=2**64), 5, "seed"),
    (SamplingParams(stop=("",)), 5, "stop"),
])
def test_validate_names_the_field(params, num_prompt_tokens, field):
    with pytest.raises(InvalidArgument, match=field):
        params.validate(max_model_len=100, num_prompt_tokens=num_prompt_tokens)


def test_valid_params_pass():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=2**64 - 1, logprobs=20).validate(100, 100)


class _NoText:
    def feed(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def test_token_ids_slice_prompt_and_output():
    request = Request(RequestId("r"), (1, 2, 3), SamplingParams(), seed=0, arrival_order=0,
                      text=TextOutput(_NoText(), ()), output_token_ids=[4, 5])
    assert request.num_tokens == 5
    assert request.token_ids(0, 5) == [1, 2, 3, 4, 5]
    assert request.token_ids(1, 2) == [2]
    assert request.token_ids(2, 4) == [3, 4]
    assert request.token_ids(3, 5) == [4, 5]
    assert request.token_ids(4, 5) == [5]
