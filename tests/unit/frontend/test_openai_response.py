"""Response and stream-chunk shapes (no sockets)."""

from __future__ import annotations

import json

import pytest

from services.common.errors import Unavailable
from services.frontend.generation import FinishReason, TokenChunk, TokenLogprob
from services.frontend.openai_protocol import parse_chat_request, parse_completion_request
from services.frontend.openai_response import SSE_DONE, ResponseFormatter, sse, sse_error
from services.frontend.tool_calls import ToolCallFormat

from tests.unit.frontend.factories import TOY_TOKENS, ToyTokens, chunk, make_state

pytestmark = pytest.mark.timeout(10)

MODEL = "tiny"


def formatter(endpoint="completions", **fields):
    if endpoint == "chat":
        parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)
    else:
        parsed = parse_completion_request({"prompt": "hi", **fields}, MODEL)
    return ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS)



def whole(f: ResponseFormatter, state) -> dict:
    return f.response([state], [f.choice(state)])

def finished_state(logprobs=False):
    state = make_state(prompt=(1, 2))
    lps = (TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5))), TokenLogprob(8, -0.25, ((8, -0.25), (7, -2.0))))
    state.accept(TokenChunk(0, (7, 8), "hi", FinishReason.STOP, logprobs=lps if logprobs else ()))
    return state


def test_completion_response():
    body = whole(formatter(return_token_ids=True), finished_state())
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "tiny",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop", "token_ids": [7, 8],
                     "prompt_token_ids": [1, 2]}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
        "prompt_token_ids": [1, 2],
    }


def test_echo_puts_the_prompt_before_the_text_whole_and_streamed():
    parsed = parse_completion_request({"prompt": "say", "echo": True, "return_token_ids": True}, MODEL)
    f = ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS, 0, echo_text="say")
    assert f.choice(finished_state())["text"] == "sayhi"
    state = make_state(prompt=(1, 2))
    (first,) = f.first_chunks(state)
    assert first["choices"] == [{"index": 0, "text": "say", "logprobs": None, "finish_reason": None,
                                 "prompt_token_ids": [1, 2], "token_ids": []}]
    assert "prompt_token_ids" not in f.chunk(state.accept(chunk(0, 7)))["choices"][0]  # named once, as vLLM does
    assert formatter().first_chunks(make_state(prompt=(1, 2))) == []  # no echo: nothing before the tokens


PROMPT_LOGPROBS = (TokenLogprob(2, -3.0, ((0, -0.1), (2, -3.0))), TokenLogprob(3, -0.5, ((3, -0.5), (1, -1.0))))


def echoed_state(logprobs=True):
    """Prompt "abcd"-ish (ids 0, 2, 3), output "hi" (7, 8); the prompt logprobs came with token 0."""
    state = make_state(prompt=(0, 2, 3))
    lps = (TokenLogprob(7, -0.5, ((7, -0.5),)), TokenLogprob(8, -0.25, ((8, -0.25),)))
    state.accept(TokenChunk(0, (7, 8), "hi", FinishReason.LENGTH, logprobs=lps if logprobs else (),
                            prompt_logprobs=PROMPT_LOGPROBS if logprobs else ()))
    return state


def test_echo_with_logprobs_scores_the_prompt_then_the_output():
    parsed = parse_completion_request({"prompt": [0, 2, 3], "echo": True, "logprobs": 1}, MODEL)
    f = ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS, 0, echo_text="acd")
    choice = f.choice(echoed_state())
    assert choice["text"] == "acdhi"
    assert choice["logprobs"] == {
        "tokens": ["a", "c", "d", "h", "i"],
        "token_logprobs": [None, -3.0, -0.5, -0.5, -0.25],
        "top_logprobs": [None, {"a": -0.1, "c": -3.0}, {"d": -0.5}, {"h": -0.5}, {"i": -0.25}],
        "text_offset": [0, 1, 2, 3, 4],
    }
    streamed = ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS, 0, echo_text="acd")
    state = make_state(prompt=(0, 2, 3))
    delta = state.accept(TokenChunk(0, (7,), "h", None, logprobs=(TokenLogprob(7, -0.5, ((7, -0.5),)),),
                                    prompt_logprobs=PROMPT_LOGPROBS))
    (echo,) = streamed.first_chunks(state)
    assert echo["choices"][0]["text"] == "acd"
    assert echo["choices"][0]["logprobs"]["token_logprobs"] == [None, -3.0, -0.5]
    assert streamed.chunk(delta)["choices"][0]["logprobs"]["text_offset"] == [3]  # after the echoed prompt


def test_vllm_prompt_logprobs_shape():
    """vLLM's: null first, then {token id: {logprob, rank, decoded_token}} of the prompt token and the top k;
    per choice for completions, at the top for chat."""
    expected = [None, {"2": {"logprob": -3.0, "rank": 4, "decoded_token": "c"},
                       "0": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}},
                {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "d"}}]
    state = make_state(prompt=(0, 2, 3))
    state.accept(TokenChunk(0, (7,), "h", FinishReason.LENGTH, prompt_logprobs=(
        TokenLogprob(2, -3.0, ((0, -0.1), (2, -3.0)), rank=4), TokenLogprob(3, -0.5, ((3, -0.5), (1, -1.0))))))
    parsed = parse_completion_request({"prompt": [0, 2, 3], "prompt_logprobs": 1}, MODEL)
    f = ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS)
    assert f.choice(state)["prompt_logprobs"] == expected
    assert "prompt_logprobs" not in ResponseFormatter(parse_completion_request({"prompt": "x"}, MODEL), "cmpl-1", 0,
                                                      TOY_TOKENS).choice(state)
    chat_parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, MODEL)
    chat_f = ResponseFormatter(chat_parsed, "chatcmpl-1", 1700000000, TOY_TOKENS)
    body = chat_f.response([state], [chat_f.choice(state)])
    assert body["prompt_logprobs"] == expected and "prompt_logprobs" not in body["choices"][0]


def test_echo_with_max_tokens_zero_shows_the_prompt_alone():
    parsed = parse_completion_request({"prompt": [0, 2, 3], "echo": True, "logprobs": 0, "max_tokens": 0,
                                       "return_token_ids": True}, MODEL)
    f = ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS, 0, echo_text="acd")
    body = f.response([echoed_state()], [f.choice(echoed_state())])
    (choice,) = body["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("acd", [], "length")
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -0.5]
    assert choice["logprobs"]["top_logprobs"] == [None, {"c": -3.0}, {"d": -0.5}]  # the token itself
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    state = make_state(prompt=(0, 2, 3))
    last = f.chunk(state.accept(TokenChunk(0, (7,), "h", FinishReason.LENGTH)))["choices"][0]
    assert (last["text"], last["token_ids"], last["finish_reason"]) == ("", [], "length")


def test_a_batch_counts_each_prompt_once_and_names_prompt_ids_per_choice():
    parsed = parse_completion_request({"prompt": ["hi", "ho"], "n": 2, "return_token_ids": True}, MODEL)
    states = [finished_state(), finished_state(), make_state(prompt=(4, 5, 6)), make_state(prompt=(4, 5, 6))]
    formatters = [ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS, index) for index in range(4)]
    body = formatters[0].response(states, [f.choice(s) for f, s in zip(formatters, states)])
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[1, 2], [1, 2], [4, 5, 6], [4, 5, 6]]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert "prompt_token_ids" not in body  # no one prompt to name at the top
    assert formatters[0].usage_chunk(states)["usage"] == body["usage"]


def test_chat_response_without_token_ids():
    body = whole(formatter("chat"), finished_state())
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]


def test_completion_logprobs_with_offsets():
    logprobs = whole(formatter(logprobs=1), finished_state(logprobs=True))["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["h", "i"], "token_logprobs": [-0.5, -0.25],
                        "top_logprobs": [{"h": -0.5}, {"i": -0.25}], "text_offset": [0, 1]}


def test_chat_logprobs():
    content = whole(formatter("chat", logprobs=True, top_logprobs=2), finished_state(True))["choices"][0]["logprobs"]
    assert content["content"][0] == {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.5, "bytes": [104]}, {"token": "i", "logprob": -1.5, "bytes": [105]}]}
    no_top = whole(formatter("chat", logprobs=True), finished_state(True))["choices"][0]["logprobs"]
    assert no_top["content"][1]["top_logprobs"] == []


def test_completion_stream_chunks():
    f = formatter(stream=True, return_token_ids=True, stream_options={"include_usage": True})
    state = make_state()
    assert f.first_chunks(state) == []
    delta = state.accept(chunk(0, 7))
    body = f.chunk(delta)
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "tiny",
                    "choices": [{"index": 0, "text": "h", "logprobs": None, "finish_reason": None,
                                 "prompt_token_ids": [1, 2, 3], "token_ids": [7]}],
                    "usage": None}
    assert "prompt_token_ids" not in f.chunk(state.accept(chunk(1, finish=FinishReason.LENGTH)))["choices"][0]
    usage = f.usage_chunk([state])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_chat_stream_chunks():
    f = formatter("chat", stream=True, return_token_ids=True)
    state = make_state()
    (first,) = f.first_chunks(state)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"] == [1, 2, 3] and "usage" not in first
    body = f.chunk(state.accept(chunk(0, 7)))
    assert body["choices"][0]["delta"] == {"content": "h"} and body["choices"][0]["token_ids"] == [7]
    last = f.chunk(state.accept(chunk(1, finish=FinishReason.STOP)))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    error = json.loads(sse_error(Unavailable("gone"))[len(b"data: "):])
    assert error == {"error": {"message": "gone", "type": "server_error", "param": None, "code": None}}


def test_completion_top_logprobs_always_hold_the_sampled_token():
    """OpenAI's completions: up to logprobs + 1 entries; logprobs 0 gives the sampled token alone."""
    for k, expected in ((0, [{"h": -0.5}, {"i": -0.25}]), (1, [{"h": -0.5}, {"i": -0.25}])):
        parsed = parse_completion_request({"prompt": [0, 2, 3], "logprobs": k}, MODEL)
        choice = ResponseFormatter(parsed, "cmpl-1", 1700000000, TOY_TOKENS, 0).choice(echoed_state())
        assert choice["logprobs"]["top_logprobs"] == expected


STAR = {20: b"\xf0\x9f", 21: b"\x8c\x9f", 22: b"!"}  # 🌟 in two byte-level pieces, then "!"


def star_state():
    state = make_state(prompt=(0,))
    lps = tuple(TokenLogprob(t, -0.5, ((t, -0.5),)) for t in (20, 21, 22))
    state.accept(TokenChunk(0, (20, 21, 22), "🌟!", FinishReason.LENGTH, logprobs=lps))
    return state


def test_a_token_inside_a_character_is_written_as_its_bytes_as_openai_does():
    parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, MODEL)
    f = ResponseFormatter(parsed, "chatcmpl-1", 1700000000, ToyTokens(STAR))
    content = f.choice(star_state())["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["bytes:\\xf0\\x9f", "bytes:\\x8c\\x9f", "!"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == "🌟!"


def test_completion_text_offsets_count_characters_not_pieces():
    parsed = parse_completion_request({"prompt": [0], "logprobs": 0}, MODEL)
    f = ResponseFormatter(parsed, "cmpl-1", 1700000000, ToyTokens(STAR))
    logprobs = f.choice(star_state())["logprobs"]
    assert logprobs["text_offset"] == [0, 1, 1]  # "🌟" is one character; "!" starts at 1


# SentencePiece-like: "▁Hi" adds " Hi" after other text, nothing before it at the text's start; 9 is </s>;
# 5 is a lone "▁" (at the start of a text the dummy space decoding drops).
WORDS = ToyTokens({0: b" Hi", 2: b" there", 3: b"!", 5: b" ", 7: b" ok", 8: b" now", 9: b"</s>"},
                  hidden=frozenset({9}))


def test_word_tokens_keep_their_space_and_the_prompt_starts_without_one():
    """Joined, the tokens are the text (OpenAI's promise), and "▁ok" and "ok" would be two keys."""
    parsed = parse_completion_request({"prompt": [0, 2, 3], "echo": True, "logprobs": 0}, MODEL)
    state = make_state(prompt=(0, 2, 3))
    lps = tuple(TokenLogprob(t, -0.5, ((t, -0.5),)) for t in (7, 9, 8))
    state.accept(TokenChunk(0, (7, 9, 8), " ok now", FinishReason.LENGTH, logprobs=lps, prompt_logprobs=PROMPT_LOGPROBS))
    choice = ResponseFormatter(parsed, "cmpl-1", 1700000000, WORDS, 0, echo_text="Hi there!").choice(state)
    assert choice["text"] == "Hi there! ok now"
    assert choice["logprobs"]["tokens"] == ["Hi", " there", "!", " ok", "</s>", " now"]
    # each token's offset is where it starts in the text; the special token, left out of it, takes no room
    assert choice["logprobs"]["text_offset"] == [0, 2, 8, 9, 12, 12]


def test_chat_token_bytes_join_to_the_content():
    parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, MODEL)
    state = make_state(prompt=(0,))
    state.accept(TokenChunk(0, (7, 8), " ok now", FinishReason.LENGTH,
                            logprobs=tuple(TokenLogprob(t, -0.5, ((t, -0.5),)) for t in (7, 8))))
    content = ResponseFormatter(parsed, "chatcmpl-1", 1700000000, WORDS).choice(state)["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [" ok", " now"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == " ok now"


@pytest.mark.parametrize("echo_text, tokens, offsets", [
    ("Hi there", ["</s>", "Hi", " there"], [0, 0, 2]),  # a text prompt: its BOS is not in the text
    ("</s> Hi there", ["</s>", " Hi", " there"], [0, 4, 7]),  # token ids echo with their special tokens
    (" Hi there", ["</s>", "", " Hi", " there"], [0, 0, 0, 3]),  # "▁▁Hi": the text's own space is the word's
])
def test_an_echoed_prompts_offsets_point_at_its_tokens_in_the_text(echo_text, tokens, offsets):
    parsed = parse_completion_request({"prompt": "Hi there", "echo": True, "logprobs": 0, "max_tokens": 0}, MODEL)
    prompt = (9, 5, 0, 2) if echo_text.startswith(" ") else (9, 0, 2)
    state = make_state(prompt=prompt)
    state.accept(TokenChunk(0, (7,), " ok", FinishReason.LENGTH, logprobs=(TokenLogprob(7, -0.5, ((7, -0.5),)),),
                            prompt_logprobs=PROMPT_LOGPROBS))
    logprobs = ResponseFormatter(parsed, "cmpl-1", 1700000000, WORDS, 0, echo_text=echo_text).choice(state)["logprobs"]
    assert (logprobs["tokens"], logprobs["text_offset"]) == (tokens, offsets)
    shown = [(token, offset) for token, offset in zip(tokens, offsets) if token in echo_text]
    assert all(echo_text.startswith(token, offset) for token, offset in shown)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALLING = 'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def tool_formatter(**fields):
    parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}, MODEL)
    return ResponseFormatter(parsed, "chatcmpl-1", 1700000000, TOY_TOKENS, tool_call_format=ToolCallFormat.HERMES)


def test_a_chat_answer_that_calls_a_tool_is_a_message_with_tool_calls_as_openai_sends_it():
    state = make_state(prompt=(1, 2))
    state.accept(TokenChunk(0, (7, 8), CALLING, FinishReason.STOP))
    choice = tool_formatter().choice(state)
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "On it." and choice["finish_reason"] == "tool_calls"
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = make_state(prompt=(1, 2))
    cut.accept(TokenChunk(0, (7, 8), CALLING, FinishReason.LENGTH))
    assert tool_formatter().choice(cut)["finish_reason"] == "length"  # as OpenAI: cut by max_tokens
    only_call = make_state(prompt=(1, 2))
    only_call.accept(TokenChunk(0, (7,), CALLING.removeprefix("On it."), FinishReason.STOP))
    assert tool_formatter().choice(only_call)["message"]["content"] is None
    text = make_state(prompt=(1, 2))
    text.accept(TokenChunk(0, (7,), "It is sunny.", FinishReason.STOP))
    assert tool_formatter().choice(text) | {"logprobs": None} == {
        "index": 0, "message": {"role": "assistant", "content": "It is sunny."}, "logprobs": None,
        "finish_reason": "stop"}
    assert tool_formatter(tool_choice="none").choice(state)["message"] == {"role": "assistant", "content": CALLING}


def test_a_streamed_tool_call_comes_whole_in_one_delta_with_its_index():
    f, state = tool_formatter(return_token_ids=True), make_state(prompt=(1, 2))
    pieces = ["On it.<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>', ""]
    chunks = []
    for i, piece in enumerate(pieces):
        finish = FinishReason.STOP if i == len(pieces) - 1 else None
        chunks.append(f.chunk(state.accept(TokenChunk(i, (7,), piece, finish)))["choices"][0])
    assert [c["delta"].get("content") for c in chunks] == ["On it.", "", None, None]
    assert [c["token_ids"] for c in chunks] == [[7], [7], [7], [7]]  # every token still shown
    (call,) = chunks[2]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_ends_with_finish_reason_tool_calls_as_vllm_answers_it(tool_choice):
    """The grammar completes with the call (the engine finishes: stop); the answer is the call."""
    forced = CALLING.removeprefix("On it.")
    state = make_state(prompt=(1, 2))
    state.accept(TokenChunk(0, (7,), forced, FinishReason.STOP))
    choice = tool_formatter(tool_choice=tool_choice).choice(state)
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    f, streamed = tool_formatter(tool_choice=tool_choice), make_state(prompt=(1, 2))
    chunks = [f.chunk(streamed.accept(TokenChunk(i, (7,), piece, FinishReason.STOP if i else None)))["choices"][0]
              for i, piece in enumerate((forced, ""))]
    assert chunks[0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [c["finish_reason"] for c in chunks] == [None, "tool_calls"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id_as_vllm_does():
    state = finished_state(logprobs=True)
    completion = formatter(logprobs=2, return_tokens_as_token_ids=True).choice(state)["logprobs"]
    assert completion["tokens"] == ["token_id:7", "token_id:8"]
    assert completion["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:8": -1.5}
    chat = formatter("chat", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True).choice(state)["logprobs"]
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in chat["content"]] == \
        [("token_id:7", ["token_id:7"]), ("token_id:8", ["token_id:8"])]
    assert chat["content"][0]["bytes"] == list(b"token_id:7")  # vLLM's
    assert formatter(logprobs=2).choice(state)["logprobs"]["tokens"] != completion["tokens"]  # text by default
