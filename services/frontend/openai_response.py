"""Responses in OpenAI's shapes: whole completions, stream chunks (SSE) and logprobs.

`ResponseFormatter` is made per choice (a request gets `n` per prompt) and
knows its endpoint, options and choice index; it turns `Delta`s and the final `ReqState`
into JSON-ready dicts. No sockets here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from services.common.errors import FerryError
from services.frontend.generation import FinishReason, TokenLogprob
from services.frontend.openai_protocol import Endpoint, ParsedRequest, error_body_for
from services.frontend.req_state import Delta, ReqState

TokenText = Callable[[int], str]  # one token id → its text

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_error(error: FerryError) -> bytes:
    return sse(error_body_for(error))


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def finish_reason_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


class ResponseFormatter:
    def __init__(self, parsed: ParsedRequest, request_id: str, created: int, token_text: TokenText,
                 index: int = 0, echo_text: str = "") -> None:
        self._parsed = parsed
        self._index = index  # of this formatter's choice
        self._echo_text = echo_text  # completions with echo: the prompt, before the output
        self._request_id = request_id
        self._created = created
        self._token_text = token_text
        self._text_offset = 0  # completions logprobs: offset of the next token in the output text
        self._is_chat = parsed.endpoint is Endpoint.CHAT

    # ---- whole responses -------------------------------------------------------------

    def response(self, states: Sequence[ReqState], choices: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The whole response: every choice (from each choice's formatter's `choice`), usage over all."""
        body = self._envelope(self._object("chat.completion", "text_completion"), list(choices))
        body["usage"] = self._usage(states)
        if self._parsed.return_token_ids and not self._parsed.is_batch:
            body["prompt_token_ids"] = list(states[0].prompt_token_ids)
        return body

    def choice(self, state: ReqState) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self._index}
        if self._is_chat:
            choice["message"] = {"role": "assistant", "content": state.text}
        else:
            choice["text"] = self._echo_text + state.text
        choice["logprobs"] = self._logprobs(state.logprobs)
        choice["finish_reason"] = finish_reason_name(state.finish_reason)
        if self._parsed.return_token_ids:
            choice["token_ids"] = list(state.token_ids)
            if not self._is_chat:  # as vLLM: each completions choice names its prompt's ids
                choice["prompt_token_ids"] = list(state.prompt_token_ids)
        return choice

    # ---- stream chunks ---------------------------------------------------------------

    def first_chunks(self, prompt_token_ids: Sequence[int]) -> list[dict[str, Any]]:
        """Chunks sent before any token: the assistant role for chat, the prompt for an echo."""
        if not self._is_chat:
            return [self._echo_chunk()] if self._echo_text else []
        choice = {"index": self._index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        if self._parsed.return_token_ids:
            choice["token_ids"] = []
        chunk = self._chunk_envelope([choice])
        if self._parsed.return_token_ids:
            chunk["prompt_token_ids"] = list(prompt_token_ids)
        return [chunk]

    def _echo_chunk(self) -> dict[str, Any]:
        choice = {"index": self._index, "text": self._echo_text, "logprobs": None, "finish_reason": None}
        if self._parsed.return_token_ids:
            choice["token_ids"] = []
        return self._chunk_envelope([choice])

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self._index}
        if self._is_chat:
            choice["delta"] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(delta.logprobs)
        choice["finish_reason"] = finish_reason_name(delta.finish_reason)
        if self._parsed.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
        return self._chunk_envelope([choice])

    def usage_chunk(self, states: Sequence[ReqState]) -> dict[str, Any]:
        chunk = self._envelope(self._object("chat.completion.chunk", "text_completion"), [])
        chunk["usage"] = self._usage(states)
        return chunk

    # ---- pieces ----------------------------------------------------------------------

    def _usage(self, states: Sequence[ReqState]) -> dict[str, int]:
        """Every choice's output; each prompt's tokens once (states[i * n] is prompt i's first choice)."""
        num_prompt_tokens = sum(len(state.prompt_token_ids) for state in states[:: self._parsed.n])
        return usage(num_prompt_tokens, sum(state.num_output_tokens for state in states))

    def _chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = self._envelope(self._object("chat.completion.chunk", "text_completion"), choices)
        if self._parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._request_id, "object": object_, "created": self._created, "model": self._parsed.model,
                "choices": choices}

    def _object(self, chat: str, completions: str) -> str:
        return chat if self._is_chat else completions

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self._parsed.num_top_logprobs is None:
            return None
        if self._is_chat:
            return {"content": [self._chat_logprob(entry) for entry in entries]}
        return self._completion_logprobs(entries)

    def _chat_logprob(self, entry: TokenLogprob) -> dict[str, Any]:
        top = entry.top[: self._parsed.num_top_logprobs]
        return {**self._token_logprob(entry.token_id, entry.logprob),
                "top_logprobs": [self._token_logprob(tid, lp) for tid, lp in top]}

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _completion_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._token_text(entry.token_id) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        n = self._parsed.num_top_logprobs
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{self._token_text(tid): lp for tid, lp in entry.top[:n]} for entry in entries],
            "text_offset": offsets,
        }
