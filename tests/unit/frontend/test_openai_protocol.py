"""Parsing and validation of OpenAI request bodies (no sockets)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.frontend.generation import Sampling
from services.frontend.chat_messages import ChatTemplateOptions
from services.frontend.error_bodies import error_body_for
from services.frontend.json_body import parse_json_body
from services.frontend.openai_protocol import (Endpoint, ModelNotFound, RequestError, parse_chat_request,
                                               parse_completion_request)
from services.frontend.prompt_checks import check_prompt_token_ids, resolve_max_tokens

pytestmark = pytest.mark.timeout(10)

MODEL = "tiny"


def completion(**fields):
    return parse_completion_request({"model": MODEL, "prompt": "hello", **fields}, MODEL)


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


def rejects(parse, fields, *words, param=None):
    with pytest.raises(RequestError) as info:
        parse(**fields)
    for word in words:
        assert word in info.value.message, info.value.message
    if param is not None:
        assert info.value.param == param
    assert info.value.http_status == 400
    return info.value


# ---- body ---------------------------------------------------------------------------


def test_json_body_must_parse_and_be_an_object():
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json_body(b'{"a": ')
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json_body(b"\xff\xfe")
    with pytest.raises(RequestError, match="must be a JSON object, got an array"):
        parse_json_body(b"[1, 2]")
    with pytest.raises(RequestError, match="nests JSON arrays or objects too deeply"):
        parse_json_body(b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(RequestError, match="an integer longer than 4300 digits") as info:
        parse_json_body(b'{"seed": ' + b"9" * 5000 + b"}")
    assert "sys." not in info.value.message
    with pytest.raises(RequestError, match="must be a JSON object, got null"):
        parse_json_body(b"null")


@pytest.mark.parametrize("raw, param", [
    (rb'{"prompt": "ok", "stop": ["\ud800"]}', "stop[0]"),
    (rb'{"messages": [{"role": "user", "content": "x\udfff"}]}', "messages[0].content"),
    (rb'{"prompt": "ok", "cache_salt": "\uDBFF"}', "cache_salt"),
    (rb'{"logit_bias": {"\ud800": 1}}', "logit_bias"),  # a bad key: the object holding it
    (b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # a surrogate's raw bytes
])
def test_a_lone_surrogate_anywhere_is_400_naming_where(raw, param):
    with pytest.raises(RequestError, match="lone UTF-16 surrogate") as info:
        parse_json_body(raw)
    assert info.value.param == param


def test_a_lone_surrogate_nested_as_deep_as_json_allows_is_400_not_a_crash():
    # json.loads takes ~1000 levels; a recursive search ran out of stack at ~500 (a 500 error)
    depth = 900
    raw = b'{"prompt": ' + b"[" * depth + rb'"\ud800"' + b"]" * depth + b"}"
    with pytest.raises(RequestError, match="lone UTF-16 surrogate") as info:
        parse_json_body(raw)
    assert info.value.param == "prompt" + "[0]" * depth


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert parse_json_body(rb'{"prompt": "\ud83d\ude00 \\ud800"}') == {"prompt": "\U0001F600 \\ud800"}


# ---- completions --------------------------------------------------------------------


def test_completion_defaults():
    parsed = completion()
    assert parsed.endpoint is Endpoint.COMPLETIONS
    assert parsed.prompts == ("hello",) and not parsed.is_batch and parsed.num_choices == 1
    assert parsed.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None, max_tokens=16)
    assert not parsed.stream and not parsed.include_usage and not parsed.return_token_ids
    assert parsed.num_top_logprobs is None
    assert parsed.priority == 0


def test_completion_all_fields():
    parsed = completion(prompt=[1, 2, 3], max_tokens=5, temperature=0, top_p=0.5, top_k=7, seed=-1,
                        stop="\n", stream=True, stream_options={"include_usage": True}, logprobs=2,
                        return_token_ids=True, ignore_eos=True, priority=3, n=1)
    assert parsed.prompts == ((1, 2, 3),)
    s = parsed.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.ignore_eos) == (0.0, 0.5, 7, 5, ("\n",), True)
    assert s.seed == 2**64 - 1  # int64 -1 as uint64
    assert s.num_logprobs == 2 and parsed.num_top_logprobs == 2
    assert parsed.stream and parsed.include_usage and parsed.return_token_ids and parsed.priority == 3


def test_completion_logprobs_zero_still_asks_the_engine_for_the_chosen_token():
    parsed = completion(logprobs=0)
    assert parsed.num_top_logprobs == 0 and parsed.sampling.num_logprobs == 1


def test_prompt_batch_of_one_is_one_prompt():
    assert completion(prompt=["hi"]).prompts == ("hi",)
    assert completion(prompt=[[5, 6]]).prompts == ((5, 6),)
    assert not completion(prompt=["hi"]).is_batch


def test_prompt_batches_mix_text_and_token_ids():
    parsed = completion(prompt=["a", [5, 6], "b"], n=2)
    assert parsed.prompts == ("a", (5, 6), "b") and parsed.is_batch
    assert (parsed.num_prompts, parsed.num_choices) == (3, 6)


def test_chat_template_kwargs_set_the_template_options_as_in_vllm():
    assert chat(chat_template_kwargs={"add_generation_prompt": False, "x": 1}).chat_template == \
        ChatTemplateOptions(False, (("x", 1),))
    options = chat(add_generation_prompt=True, chat_template_kwargs={"add_generation_prompt": False,
                                                                     "continue_final_message": True}).chat_template
    assert options == ChatTemplateOptions(False, (), continue_final_message=True)


def test_fractions_too_small_for_float32_keep_their_meaning_on_the_wire():
    # float32 rounds 1e-46 to 0, which the instance reads as unset (top_p 1, no penalty)
    sampling = completion(top_p=1e-300, repetition_penalty=1e-300).sampling
    assert 0 < sampling.top_p <= 1e-30 and 0 < sampling.repetition_penalty <= 1e-30
    assert completion(top_p=0.5).sampling.top_p == 0.5


def test_chat_template_options():
    assert chat().chat_template == ChatTemplateOptions(True, ())
    options = chat(add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False, "a": 1}).chat_template
    assert options == ChatTemplateOptions(False, (("a", 1), ("enable_thinking", False)))
    for kwargs in ([1], {f"k{i}": i for i in range(33)}):
        rejects(chat, {"chat_template_kwargs": kwargs}, "chat_template_kwargs", param="chat_template_kwargs")
    rejects(chat, {"chat_template_kwargs": {"messages": []}}, "leave it out", param="chat_template_kwargs.messages")


@pytest.mark.parametrize("fields, name", [
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"skip_special_tokens": False}, "skip_special_tokens"), ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": ["x"]}, "bad_words"), ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_output_options_ferry_would_otherwise_ignore_are_refused(fields, name):
    rejects(completion, fields, name, param=name)
    rejects(chat, fields, name, param=name)
    assert completion(skip_special_tokens=True, include_stop_str_in_output=False, guided_json=None).prompts


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": {"type": "object"}}, "guided_json"), ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"guided_regex": "a+"}, "guided_regex"), ({"guided_grammar": "start: \"x\""}, "guided_grammar"),
    ({"structured_outputs": {"json": {}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_structured_output_fields_become_the_requests_constraint(fields, param):
    for parsed in (completion(**fields), chat(**fields)):
        assert parsed.constraint is not None and parsed.constraint.param == param and parsed.needs_grammar
        assert parsed.sampling.grammar == ""  # the served model checks it and sets it (ServedModel.constrained)
    assert completion(response_format={"type": "text"}).constraint is None


def test_add_special_tokens_for_completions_only():
    assert completion().add_special_tokens and not completion(add_special_tokens=False).add_special_tokens
    assert chat(add_special_tokens=False).prompts == ()
    rejects(chat, {"add_special_tokens": True}, "add_special_tokens", "chat template", param="add_special_tokens")


def test_truncate_prompt_tokens():
    assert completion(truncate_prompt_tokens=5).truncate_prompt_tokens == 5
    assert chat(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    assert completion().truncate_prompt_tokens is None
    rejects(completion, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", param="truncate_prompt_tokens")


def test_stop_token_ids_and_min_tokens():
    assert completion(stop_token_ids=[2, 7]).sampling.stop_token_ids == (2, 7)
    assert chat(stop_token_ids=None, min_tokens=0).sampling.stop_token_ids == ()
    assert completion(min_tokens=4, max_tokens=4).sampling.min_tokens == 4 and completion().sampling.min_tokens == 0
    with pytest.raises(RequestError, match="min_tokens: 5 is more than max_tokens") as info:
        resolve_max_tokens(completion(min_tokens=5, max_tokens=4), num_prompt_tokens=3, max_model_len=64)
    assert info.value.param == "min_tokens"
    with pytest.raises(RequestError, match=r"min_tokens: 70 is more than max_tokens \(54, what the context leaves"):
        resolve_max_tokens(chat(min_tokens=70), num_prompt_tokens=10, max_model_len=64)


def test_echo_is_a_completions_option():
    assert completion(echo=True).echo and not completion().echo and not completion(echo=False, logprobs=2).echo


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    assert completion(echo=True, logprobs=3).sampling.num_prompt_logprobs == 3
    assert completion(echo=True, logprobs=0).sampling.num_prompt_logprobs == 0
    assert completion(echo=True).sampling.num_prompt_logprobs is None
    assert completion(logprobs=3).sampling.num_prompt_logprobs is None  # no echo: the prompt is not in the answer


def test_vllm_prompt_logprobs_ask_the_engine_for_the_prompts_logprobs():
    assert completion(prompt_logprobs=2).sampling.num_prompt_logprobs == completion(prompt_logprobs=2).prompt_logprobs == 2
    assert chat(prompt_logprobs=0).sampling.num_prompt_logprobs == 0
    both = completion(prompt_logprobs=1, echo=True, logprobs=4)  # one engine ask for both shapes: the larger top
    assert (both.sampling.num_prompt_logprobs, both.prompt_logprobs, both.num_top_logprobs) == (4, 1, 4)


def test_echo_with_max_tokens_zero_is_the_prompt_alone():
    parsed = completion(echo=True, logprobs=1, max_tokens=0)
    assert parsed.echo_only and parsed.sampling.max_tokens == 1  # one token runs; the answer leaves it out
    assert not completion(echo=True, max_tokens=1).echo_only and not completion(echo=True).echo_only


def test_chat_is_one_prompt():
    parsed = chat(n=3)
    assert (parsed.prompts, parsed.num_prompts, parsed.num_choices, parsed.is_batch) == ((), 1, 3, False)


@pytest.mark.parametrize("prompt, n, words, param", [
    (["a", ""], 1, ["prompt[1]", "must not be empty"], "prompt[1]"),  # param: the field the message names
    ([[1, 2], []], 1, ["prompt[1]", "must not be empty"], "prompt[1]"),
    (["a", [1, "x"]], 1, ["prompt[1][1]", "expected a token id", "a string"], "prompt[1][1]"),
    (["a", "b", 5], 1, ["prompt[2]", "expected a string or a list of token ids", "number 5"], "prompt[2]"),
    (["a"] * 65, 1, ["at most 64 prompts", "got 65"], "prompt"),
    (["a"] * 9, 16, ["16 choices for each of 9 prompts", "144 answers", "at most 128"], "n"),
])
def test_bad_prompt_batches(prompt, n, words, param):
    rejects(completion, {"prompt": prompt, "n": n}, *words, param=param)


@pytest.mark.parametrize("prompt, words", [
    (None, ["prompt", "required"]),
    ("", ["prompt", "empty"]),
    ([], ["prompt", "empty"]),
    (5, ["prompt", "expected a string or a list of token ids", "number 5"]),
    ({"text": "x"}, ["prompt", "an object"]),
])
def test_bad_prompts(prompt, words):
    rejects(completion, {"prompt": prompt}, *words, param="prompt")


@pytest.mark.parametrize("prompt, param, words", [
    ([1, "a"], "prompt[1]", ["expected a token id", "a string"]),
    ([1, True], "prompt[1]", ["expected a token id", "boolean true"]),
    (["a", 5], "prompt[1]", ["expected a string or a list of token ids", "number 5"]),
    ([{"text": "x"}], "prompt[0]", ["expected a string or a list of token ids", "an object"]),
])
def test_a_bad_item_is_named_by_its_index(prompt, param, words):
    rejects(completion, {"prompt": prompt}, param, *words, param=param)


def test_missing_prompt():
    with pytest.raises(RequestError, match="prompt: required"):
        parse_completion_request({"model": MODEL}, MODEL)


@pytest.mark.parametrize("fields, words, param", [
    ({"n": 17}, ["n", "between 1 and 16"], "n"),
    ({"n": 0}, ["n", "between 1 and 16", "got 0"], "n"),
    ({"max_tokens": 0}, ["max_tokens", "at least 1", "0 only with echo"], "max_tokens"),
    ({"max_tokens": 0, "echo": False}, ["max_tokens", "0 only with echo"], "max_tokens"),
    ({"max_tokens": -3}, ["max_tokens", ">= 0"], "max_tokens"),
    ({"max_tokens": "10"}, ["max_tokens", "expected an integer", "a string"], "max_tokens"),
    ({"max_tokens": 1.5}, ["max_tokens", "expected an integer"], "max_tokens"),
    ({"max_tokens": True}, ["max_tokens", "expected an integer", "boolean"], "max_tokens"),
    ({"temperature": -0.1}, ["temperature", "between 0.0 and 2.0"], "temperature"),
    ({"temperature": 2.5}, ["temperature", "between 0.0 and 2.0"], "temperature"),
    ({"temperature": "hot"}, ["temperature", "expected a number"], "temperature"),
    ({"top_p": 0}, ["top_p", "(0, 1]"], "top_p"),
    ({"top_p": 1.5}, ["top_p", "(0, 1]"], "top_p"),
    ({"top_k": -2}, ["top_k"], "top_k"),
    ({"seed": "x"}, ["seed", "expected an integer"], "seed"),
    ({"stop": 5}, ["stop", "a string or a list of strings"], "stop"),
    ({"stop": ["a", 1]}, ["stop[1]", "expected a string", "number 1"], "stop[1]"),
    ({"stop": [""]}, ["stop[0]", "empty"], "stop[0]"),
    ({"stop": ""}, ["stop", "empty"], "stop"),
    ({"stop": ["x"] * 17}, ["stop", "at most 16"], "stop"),
    ({"stream": "yes"}, ["stream", "true or false"], "stream"),
    ({"stream_options": {"include_usage": True}}, ["stream_options", "stream is true"], "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, ["include_usage", "true or false"],
     "stream_options.include_usage"),
    ({"logprobs": 21}, ["logprobs", "between 0 and 20"], "logprobs"),
    ({"logprobs": True}, ["logprobs", "expected an integer"], "logprobs"),
    ({"return_token_ids": "yes"}, ["return_token_ids", "true or false"], "return_token_ids"),
    ({"ignore_eos": 1}, ["ignore_eos", "true or false"], "ignore_eos"),
    ({"priority": "high"}, ["priority", "expected an integer"], "priority"),
    ({"best_of": 3}, ["best_of"], "best_of"),
    ({"stop_token_ids": [1, -2]}, ["stop_token_ids[1]", "non-negative integers", "got -2"], "stop_token_ids[1]"),
    ({"stop_token_ids": [1, "7"]}, ["stop_token_ids[1]", "got \"7\""], "stop_token_ids[1]"),
    ({"stop_token_ids": 5}, ["stop_token_ids", "number 5"], "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, ["stop_token_ids", "at most 64"], "stop_token_ids"),
    ({"min_tokens": -1}, ["min_tokens", ">= 0"], "min_tokens"),
    ({"presence_penalty": 2.5}, ["presence_penalty", "between -2.0 and 2.0"], "presence_penalty"),
    ({"frequency_penalty": "lots"}, ["frequency_penalty", "expected a number"], "frequency_penalty"),
    ({"logit_bias": [1, 5]}, ["logit_bias", "an object of token id -> bias"], "logit_bias"),
    ({"repetition_penalty": 0}, ["repetition_penalty", "(0, 2]"], "repetition_penalty"),
    ({"repetition_penalty": 3}, ["repetition_penalty", "<= 2.0"], "repetition_penalty"),
    ({"min_p": 1.5}, ["min_p", "between 0.0 and 1.0"], "min_p"),
    ({"cache_salt": ""}, ["cache_salt", "1 to 256", "0 characters"], "cache_salt"),
    ({"cache_salt": "x" * 257}, ["cache_salt", "257 characters"], "cache_salt"),
    ({"cache_salt": 42}, ["cache_salt", "expected a string"], "cache_salt"),
    ({"logit_bias": {"the": 5}}, ["logit_bias", "token ids", "'the'"], "logit_bias"),
    ({"logit_bias": {"-1": 5}}, ["logit_bias", "token ids"], "logit_bias"),
    ({"logit_bias": {"¹": 5}}, ["logit_bias", "token ids"], "logit_bias"),  # str.isdigit() says yes, int() no
    ({"logit_bias": {"٣": 5}}, ["logit_bias", "token ids"], "logit_bias"),
    ({"tool_choice": "required"}, ["tool_choice", "only allowed with tools"], "tool_choice"),
    ({"logit_bias": {"1": 101}}, ["logit_bias.1", "between -100.0 and 100.0"], "logit_bias.1"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, ["logit_bias", "at most 1024"], "logit_bias"),
    ({"response_format": {"type": "yaml"}}, ["response_format.type", "'yaml'", "json_schema"], "response_format.type"),
    ({"response_format": "json"}, ["response_format", "a string"], "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, ["tools", "chat completions", "tool_choice"], "tools"),
    ({"functions": [{"name": "f"}]}, ["functions", "not supported"], "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, ["audio", "text only"], "audio"),
    ({"modalities": ["text", "audio"]}, ["modalities[1]", "only [\"text\"]", "'audio'"], "modalities[1]"),
    ({"modalities": "text"}, ["modalities"], "modalities"),
    ({"model": 7}, ["model", "expected a string"], "model"),
    ({"temperature": 10**400}, ["temperature", "too large"], "temperature"),
    ({"top_p": -10**400}, ["top_p", "too large"], "top_p"),
    ({"logit_bias": {"1": 10**400}}, ["logit_bias.1", "too large"], "logit_bias.1"),
    ({"logit_bias": {"1" * 5000: 1}}, ["logit_bias", "token ids"], "logit_bias"),  # int() refuses 4300+ digits
    ({"logit_bias": {"1": 5, "01": 1}}, ["logit_bias", "'1' and '01' both name token 1"], "logit_bias"),
    ({"logit_bias": {"7": None}}, ["logit_bias.7", "expected a number, got null"], "logit_bias.7"),
    ({"user": 5}, ["user", "expected a string", "number"], "user"),
])
def test_bad_completion_fields(fields, words, param):
    rejects(completion, fields, *words, param=param)


def test_vllm_options_not_served_are_refused_not_ignored():
    with pytest.raises(RequestError, match="echo: not supported for chat") as info:
        chat(echo=True)
    assert info.value.param == "echo"
    assert chat(echo=False).endpoint is Endpoint.CHAT
    with pytest.raises(RequestError, match="continuous_usage_stats: not supported") as info:
        completion(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert info.value.param == "stream_options.continuous_usage_stats"


def test_text_output_modalities_are_served():
    assert chat(modalities=["text"]).endpoint is Endpoint.CHAT
    assert chat(modalities=None, audio=None).endpoint is Endpoint.CHAT


def test_an_instances_400_names_the_field_its_message_starts_with():
    error = error_body_for(InvalidArgument("logit_bias: token id 999999 is outside the vocabulary [0, 100)"))["error"]
    assert error["param"] == "logit_bias"
    assert error_body_for(InvalidArgument("the prompt is too long: shorten it"))["error"]["param"] is None


@pytest.mark.parametrize("parse", [completion, chat])
def test_an_unknown_model_is_404_model_not_found_as_openai_answers(parse):
    with pytest.raises(ModelNotFound) as info:
        parse(model="gpt-4")
    assert info.value.http_status == 404 and "'gpt-4' does not exist" in info.value.message
    error = error_body_for(info.value)["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")


def test_missing_model_means_the_served_one():
    assert parse_completion_request({"prompt": "x"}, MODEL).model == MODEL


def test_penalties_of_zero_and_unknown_fields_are_accepted():
    assert completion(presence_penalty=0, frequency_penalty=0.0, user="u", whatever=1).prompts == ("hello",)


def test_plain_text_format_and_declined_tools_are_accepted():
    assert completion(response_format={"type": "text"}).prompts == ("hello",)
    assert completion(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none").prompts == ("hello",)
    assert completion(tools=[]).prompts == ("hello",)


def test_penalties_and_logit_bias_reach_the_sampling_parameters():
    sampling = completion(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100, "3": 2.5}).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    vllm_style = completion(repetition_penalty=1.2, min_p=0.1).sampling
    assert (vllm_style.repetition_penalty, vllm_style.min_p) == (1.2, 0.1)
    assert (completion().sampling.repetition_penalty, completion().sampling.min_p) == (1.0, 0.0)


def test_cache_salt_reaches_the_sampling_parameters():
    assert completion(cache_salt="tenant-a").sampling.cache_salt == "tenant-a"
    assert completion().sampling.cache_salt == ""


# ---- chat ---------------------------------------------------------------------------


def test_chat_defaults_and_content_parts():
    parsed = chat(messages=[{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                            {"role": "assistant", "content": None}])
    assert parsed.endpoint is Endpoint.CHAT
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]  # the tokenizer joins them or not, per template
    assert parsed.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": parts},
                               {"role": "assistant", "content": ""})
    assert parsed.sampling.max_tokens is None  # rest of the context, once the prompt is known
    assert parsed.num_top_logprobs is None


def test_the_developer_role_is_the_system_role():
    assert chat(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]).messages[0] \
        == {"role": "system", "content": "be brief"}


def test_continue_final_message():
    options = chat(continue_final_message=True).chat_template
    assert (options.continue_final_message, options.add_generation_prompt) == (True, False)
    assert chat(continue_final_message=True, add_generation_prompt=False).chat_template == options
    rejects(chat, {"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
            "add_generation_prompt", param="continue_final_message")
    rejects(chat, {"continue_final_message": "yes"}, "continue_final_message", "true or false",
            param="continue_final_message")


def test_chat_max_completion_tokens_wins():
    assert chat(max_tokens=5, max_completion_tokens=7).sampling.max_tokens == 7
    assert chat(max_tokens=5).sampling.max_tokens == 5


def test_a_context_overflow_names_the_field_the_client_sent():
    with pytest.raises(RequestError, match="reduce max_completion_tokens to at most 14") as info:
        resolve_max_tokens(chat(max_completion_tokens=20), num_prompt_tokens=50, max_model_len=64)
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(RequestError, match="reduce max_tokens to at most 14") as info:
        resolve_max_tokens(chat(max_tokens=20), num_prompt_tokens=50, max_model_len=64)
    assert info.value.param == "max_tokens"


def test_param_is_as_exact_as_the_field_the_message_names():
    assert RequestError("prompt[1]: must not be empty", param="prompt").param == "prompt[1]"
    assert RequestError("messages[0].content[2]: bad", param="messages[0].content").param == "messages[0].content[2]"
    assert RequestError("prompt[1]: too long for the context", param="max_tokens").param == "max_tokens"
    assert RequestError("the request body is not valid JSON: x").param is None


def test_chat_logprobs():
    assert chat(logprobs=True).num_top_logprobs == 0
    parsed = chat(logprobs=True, top_logprobs=3)
    assert parsed.num_top_logprobs == 3 and parsed.sampling.num_logprobs == 3
    assert chat(logprobs=False).num_top_logprobs is None


@pytest.mark.parametrize("fields, words, param", [
    ({"messages": None}, ["messages", "required"], "messages"),
    ({"messages": []}, ["messages", "non-empty list, got an empty list"], "messages"),
    ({"messages": "hi"}, ["messages", "non-empty list", "a string"], "messages"),
    ({"messages": ["hi"]}, ["messages[0]", "object with role"], "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, ["messages[0].role", "wizard"], "messages[0].role"),
    ({"messages": [{"content": "x"}]}, ["messages[0].role"], "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, ["messages[0].content"], "messages[0].content"),
    ({"messages": [{"role": "user"}]}, ["messages[0].content"], "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     ["only text parts", "'image_url'"], "messages[0].content[0].type"),
    ({"max_completion_tokens": 0}, ["max_completion_tokens", ">= 1"], "max_completion_tokens"),
    ({"logprobs": 1}, ["logprobs", "true or false"], "logprobs"),
    ({"top_logprobs": 2}, ["top_logprobs", "logprobs=true"], "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, ["top_logprobs", "between 0 and 20"], "top_logprobs"),
    ({"n": 30}, ["n", "between 1 and 16", "got 30"], "n"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, ["messages[0].name", "a string"],
     "messages[0].name"),
    ({"max_completion_tokens": 5, "max_tokens": -7}, ["max_tokens", ">= 1"], "max_tokens"),
    ({"chat_template_kwargs": {"add_generation_prompt": 5}}, ["chat_template_kwargs.add_generation_prompt",
     "true or false"], "chat_template_kwargs.add_generation_prompt"),
])
def test_bad_chat_fields(fields, words, param):
    rejects(chat, fields, *words, param=param)


def test_missing_messages():
    with pytest.raises(RequestError, match="messages: required"):
        parse_chat_request({"model": MODEL}, MODEL)


# ---- against the context ------------------------------------------------------------


def test_max_tokens_defaults_to_the_rest_of_the_context():
    assert resolve_max_tokens(chat(), num_prompt_tokens=10, max_model_len=64).sampling.max_tokens == 54
    assert resolve_max_tokens(completion(max_tokens=4), 10, 64).sampling.max_tokens == 4


def test_prompt_longer_than_the_context_is_rejected():
    with pytest.raises(RequestError) as info:
        resolve_max_tokens(completion(), num_prompt_tokens=64, max_model_len=64)
    assert "64 tokens" in info.value.message and "maximum context length" in info.value.message
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_a_completion_without_max_tokens_is_told_its_default_16_did_not_fit():
    """The client sent no max_tokens: the message must not read as if it asked for 16 (a black-box run)."""
    with pytest.raises(RequestError, match=r"16 for the output, the default max_tokens\); set max_tokens to at most 6"):
        resolve_max_tokens(completion(), num_prompt_tokens=58, max_model_len=64)


def test_prompt_plus_max_tokens_over_the_context_is_rejected():
    with pytest.raises(RequestError, match="reduce max_tokens to at most 14") as info:
        resolve_max_tokens(completion(max_tokens=20), num_prompt_tokens=50, max_model_len=64)
    assert info.value.param == "max_tokens"


def test_a_batch_prompt_over_the_context_is_named():
    batch = completion(prompt=["a", "b"], max_tokens=20)
    with pytest.raises(RequestError, match=r"^max_tokens: this model's maximum context length is 64 tokens; you "
                                           r"requested 70 tokens \(50 in prompt\[1\], .* or shorten prompt\[1\]$"):
        resolve_max_tokens(batch, num_prompt_tokens=50, max_model_len=64, prompt_index=1)
    with pytest.raises(RequestError, match=r"^prompt\[0\]: the prompt is 70 tokens"):
        resolve_max_tokens(batch, num_prompt_tokens=70, max_model_len=64, prompt_index=0)


def test_prompt_token_ids_must_be_in_the_vocabulary():
    check_prompt_token_ids([0, 5, 9], vocab_size=10)
    with pytest.raises(RequestError, match="token id 10 is outside the vocabulary"):
        check_prompt_token_ids([1, 10], vocab_size=10)
    with pytest.raises(RequestError, match="token id -1"):
        check_prompt_token_ids([-1], vocab_size=10)
    with pytest.raises(RequestError, match=r"^prompt\[3\]: token id 10") as info:
        check_prompt_token_ids([10], vocab_size=10, name="prompt[3]")
    assert info.value.param == "prompt[3]"


def test_error_body_shape():
    error = rejects(completion, {"temperature": 9})
    assert error_body_for(error) == {"error": {
        "message": error.message, "type": "invalid_request_error", "param": "temperature", "code": None}}


TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def test_tools_with_tool_choice_auto_ask_for_parsed_calls_and_none_for_none():
    assert chat(tools=TOOLS).tool_use.parses_calls
    assert chat(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False).tool_use.max_calls == 1
    assert chat(tools=TOOLS, parallel_tool_calls=True).tool_use.max_calls is None
    assert not chat(tools=TOOLS, tool_choice="none").tool_use.parses_calls
    assert not chat().tool_use.parses_calls and not chat(tools=[]).tool_use.parses_calls


def test_tool_choice_required_and_named_force_calls_of_the_tools_they_name():
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    required = chat(tools=tools, tool_choice="required").tool_use
    assert required.is_forced and required.parses_calls and required.max_calls is None
    assert [(f.index, f.name) for f in required.functions] == [(0, "get_weather"), (1, "get_time")]
    assert chat(tools=tools, tool_choice="required", parallel_tool_calls=False).tool_use.max_calls == 1
    named = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}).tool_use
    assert named.is_forced and named.max_calls == 1 and [(f.index, f.name) for f in named.functions] == [(1, "get_time")]
    assert not chat(tools=tools).tool_use.is_forced and not chat(tools=tools).needs_grammar
    auto_json = chat(tools=tools, response_format={"type": "json_object"})  # calls, or the answer as JSON
    assert auto_json.tool_use.parses_calls and auto_json.constraint.is_json
    assert chat(tools=tools, tool_choice="none", guided_regex="[0-9]+").constraint.param == "guided_regex"


@pytest.mark.parametrize("fields,words,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     ["tool_choice.function.name", "'get_time'", "'get_weather'"], "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, ["tool_choice.function", "null"], "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, ["tool_choice", "'sometimes'"], "tool_choice"),
    ({"tools": [{"function": {"name": "f", "parameters": [1]}}]}, ["tools[0].function.parameters", "JSON schema"],
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     ["response_format", "tool_choice \"required\""], "response_format"),
    ({"tools": TOOLS, "tool_choice": {"function": {"name": "get_weather"}}, "guided_json": {"type": "object"}},
     ["guided_json", "naming a function"], "guided_json"),
    ({"tools": TOOLS, "guided_regex": "[0-9]+"}, ["guided_regex", "tool_choice \"auto\"", "\"none\""],
     "guided_regex"),
    ({"tool_choice": "auto"}, ["tool_choice", "only allowed with tools"], "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, ["parallel_tool_calls", "true or false"], "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {}}]}, ["tools[0].function.name", "null"], "tools[0].function.name"),
    ({"functions": [{"name": "f"}]}, ["functions", "not supported", "tools"], "functions"),
])
def test_bad_tool_fields(fields, words, param):
    rejects(chat, fields, *words, param=param)


@pytest.mark.parametrize("field,value,words", [
    ("chat_template", "{{ messages[0].content }}", ["own chat template is not run"]),
    ("logits_processors", ["x"], ["not run"]),
    ("prompt_embeds", "AAAA", ["embeddings"]),
    ("guided_whitespace_pattern", "[ ]*", ["one fixed whitespace"]),
])
def test_vllm_fields_that_would_change_the_answer_are_refused_not_ignored(field, value, words):
    rejects(chat, {field: value}, field, *words, param=field)


def test_tool_calls_and_results_in_the_history_reach_the_template_as_transformers_takes_them():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    parsed = chat(messages=messages, tools=TOOLS)
    assert parsed.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert parsed.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message,words,param", [
    ({"role": "user", "content": "x", "tool_calls": []}, ["only assistant"], "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": {"a": 1}}, ["expected a list"], "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"function": {}}]}, ["expected a non-empty string"],
     "messages[0].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     ["not valid JSON"], "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     ["a JSON object"], "messages[0].tool_calls[0].function.arguments"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, ["expected a string"], "messages[0].tool_call_id"),
])
def test_bad_tool_fields_in_messages_name_the_field(message, words, param):
    rejects(chat, {"messages": [message]}, *words, param=param)
