"""Responses in OpenAI's shapes: whole completions, stream chunks (SSE) and logprobs.

`ResponseFormatter` is made per choice (a request gets `n` per prompt) and
knows its endpoint, options and choice index; it turns `Delta`s and the final `ReqState`
into JSON-ready dicts. No sockets here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from services.common.errors import FerryError
from services.frontend.generation import FinishReason, TokenLogprob
from services.frontend.error_bodies import error_body_for
from services.frontend.openai_protocol import Endpoint, ParsedRequest
from services.frontend.req_state import Delta, ReqState
from services.frontend.tool_calls import Parsed, ToolCallFormat, ToolCallParser


class TokenStrings(Protocol):
    """What logprobs show of a token (the served model's tokenizer)."""

    def token_text(self, token_id: int) -> str:
        """Its text alone, as at the start of a text."""

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes it adds after other text (maybe part of a character, maybe a leading space)."""

    def is_hidden(self, token_id: int) -> bool:
        """Left out of output text (a special token)."""


SSE_DONE = b"data: [DONE]\n\n"
_SSE_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # one for every chunk (json.dumps makes one a call)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _SSE_JSON.encode(payload).encode() + b"\n\n"


def sse_error(error: FerryError) -> bytes:
    return sse(error_body_for(error))


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def finish_reason_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


class ResponseFormatter:
    def __init__(self, parsed: ParsedRequest, request_id: str, created: int, tokens: TokenStrings,
                 index: int = 0, echo_text: str = "", tool_call_format: ToolCallFormat | None = None,
                 hidden_markers: tuple[str, ...] = ()) -> None:
        self._parsed = parsed
        self._index = index  # of this formatter's choice
        self._echo_text = echo_text  # completions with echo: the prompt, before the output
        self._request_id = request_id
        self._created = created
        self._tokens = tokens
        self._text_offset = len(echo_text)  # completions logprobs: offset of the next output token in the text
        self._is_chat = parsed.endpoint is Endpoint.CHAT
        # completions echo with logprobs: the prompt's tokens and logprobs come first (its first token has none)
        self._echoes_logprobs = parsed.echo and not self._is_chat and parsed.num_top_logprobs is not None
        self._hides_output = parsed.echo_only  # max_tokens 0: the prompt alone; the one token run is not shown
        # chat with tools (tool_choice auto): tool calls are parsed out of the answer
        self._tool_call_format = tool_call_format if self._is_chat and parsed.tool_use.parses_calls else None
        self._hidden_markers = hidden_markers  # special tokens shown to the parser only (ServedModel.shown_marker_ids)
        self._streamed_calls = self._tool_call_parser()  # the stream's parser (None: no tool calls)
        self._num_streamed_calls = 0
        self._unsent_prompt_ids: list[int] | None = None  # completions stream: for the choice's first chunk

    # ---- whole responses -------------------------------------------------------------

    def response(self, states: Sequence[ReqState], choices: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The whole response: every choice (from each choice's formatter's `choice`), usage over all."""
        body = self._envelope(self._object("chat.completion", "text_completion"), list(choices))
        if self._is_chat and self._parsed.prompt_logprobs is not None:  # vLLM: one prompt, at the top
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(states[0])
        body["usage"] = self._usage(states)
        if self._parsed.return_token_ids and not self._parsed.is_batch:
            body["prompt_token_ids"] = list(states[0].prompt_token_ids)
        return body

    def choice(self, state: ReqState) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self._index}
        if self._is_chat:
            choice["message"] = self._message(state.text)
        else:
            choice["text"] = self._echo_text + ("" if self._hides_output else state.text)
        output_logprobs = self._logprobs(() if self._hides_output else state.logprobs)
        if self._echoes_logprobs:
            output_logprobs = _joined(self._prompt_logprobs(state), output_logprobs)
        choice["logprobs"] = output_logprobs
        choice["finish_reason"] = self._finish_reason(state.finish_reason, "tool_calls" in choice.get("message", {}))
        if not self._is_chat and self._parsed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(state)
        if self._parsed.return_token_ids:
            choice["token_ids"] = [] if self._hides_output else list(state.token_ids)
            if not self._is_chat:  # as vLLM: each completions choice names its prompt's ids
                choice["prompt_token_ids"] = list(state.prompt_token_ids)
        return choice

    # ---- stream chunks ---------------------------------------------------------------

    def first_chunks(self, state: ReqState) -> list[dict[str, Any]]:
        """Chunks sent before the first token's: the assistant role for chat, the prompt for an echo
        (sent once the first token came, which brings the prompt's logprobs)."""
        if not self._is_chat:
            if self._parsed.return_token_ids:  # as vLLM: each choice's first chunk names its prompt's ids
                self._unsent_prompt_ids = list(state.prompt_token_ids)
            return [self._echo_chunk(state)] if self._parsed.echo else []
        choice = {"index": self._index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        if self._parsed.return_token_ids:
            choice["token_ids"] = []
        chunk = self._chunk_envelope([choice])
        if self._parsed.return_token_ids:
            chunk["prompt_token_ids"] = list(state.prompt_token_ids)
        return [chunk]

    def _echo_chunk(self, state: ReqState) -> dict[str, Any]:
        logprobs = self._prompt_logprobs(state) if self._echoes_logprobs else None
        choice = {"index": self._index, "text": self._echo_text, "logprobs": logprobs, "finish_reason": None}
        self._add_token_ids(choice, [])
        return self._chunk_envelope([choice])

    def _add_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> None:
        if not self._parsed.return_token_ids:
            return
        if self._unsent_prompt_ids is not None:
            choice["prompt_token_ids"], self._unsent_prompt_ids = self._unsent_prompt_ids, None
        choice["token_ids"] = token_ids

    def chunk(self, delta: Delta) -> dict[str, Any]:
        if self._hides_output:
            delta = Delta(delta.token_index, (), "", (), delta.finish_reason)
        choice: dict[str, Any] = {"index": self._index}
        if self._is_chat:
            choice["delta"] = self._chat_delta(delta)
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(delta.logprobs)
        has_called = self._streamed_calls is not None and self._streamed_calls.has_called
        choice["finish_reason"] = self._finish_reason(delta.finish_reason, has_called)
        self._add_token_ids(choice, list(delta.token_ids))
        return self._chunk_envelope([choice])

    def _chat_delta(self, delta: Delta) -> dict[str, Any]:
        parsed = Parsed(delta.text)
        if self._streamed_calls is not None:
            parsed = self._streamed_calls.feed(delta.text, is_last=delta.finish_reason is not None)
        shows_content = parsed.content or (delta.finish_reason is None and not parsed.tool_calls)
        out: dict[str, Any] = {"content": parsed.content} if shows_content else {}
        if parsed.tool_calls:
            out["tool_calls"] = [call.to_openai(index) for index, call in
                                 enumerate(parsed.tool_calls, start=self._num_streamed_calls)]
            self._num_streamed_calls += len(parsed.tool_calls)
        return out

    # ---- tool calls ------------------------------------------------------------------

    def _tool_call_parser(self) -> ToolCallParser | None:
        if self._tool_call_format is None:
            return None
        return ToolCallParser(self._tool_call_format, self._parsed.tool_use.max_calls, self._hidden_markers)

    def _message(self, text: str) -> dict[str, Any]:
        parser = self._tool_call_parser()
        if parser is None:
            return {"role": "assistant", "content": text}
        parsed = parser.feed(text, is_last=True)
        if not parsed.tool_calls:
            return {"role": "assistant", "content": parsed.content}
        return {"role": "assistant", "content": parsed.content or None,
                "tool_calls": [call.to_openai() for call in parsed.tool_calls]}

    @staticmethod
    def _finish_reason(reason: FinishReason | None, has_called: bool) -> str | None:
        """An answer that called tools and ended by itself ends with "tool_calls"; one cut by
        max_tokens stays "length", as OpenAI says it (vLLM says "tool_calls" there too)."""
        return "tool_calls" if reason is FinishReason.STOP and has_called else finish_reason_name(reason)

    def usage_chunk(self, states: Sequence[ReqState]) -> dict[str, Any]:
        chunk = self._envelope(self._object("chat.completion.chunk", "text_completion"), [])
        chunk["usage"] = self._usage(states)
        return chunk

    # ---- pieces ----------------------------------------------------------------------

    def _usage(self, states: Sequence[ReqState]) -> dict[str, int]:
        """Every choice's output; each prompt's tokens once (states[i * n] is prompt i's first choice)."""
        num_prompt_tokens = sum(len(state.prompt_token_ids) for state in states[:: self._parsed.n])
        num_output_tokens = 0 if self._hides_output else sum(state.num_output_tokens for state in states)
        return usage(num_prompt_tokens, num_output_tokens)

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
        token = self._token(token_id)
        shown = token.encode() if self._parsed.tokens_as_ids else self._tokens.token_bytes(token_id)  # as vLLM
        return {"token": token, "logprob": logprob, "bytes": list(shown)}

    def _token(self, token_id: int) -> str:
        """The token as OpenAI writes it: the text it adds (" word" for a SentencePiece "▁word"), or
        where its bytes are only part of a character (a piece of an emoji), `bytes:` and the bytes
        escaped (`bytes:\\xf0\\x9f`); with vLLM's return_tokens_as_token_ids, `token_id:N`."""
        if self._parsed.tokens_as_ids:
            return f"token_id:{token_id}"
        return _shown(self._tokens.token_bytes(token_id))

    def _num_chars(self, token_id: int) -> int:
        """Characters the token starts in the output text (a character's continuation bytes start
        none; a special token, left out of the text, none)."""
        if self._tokens.is_hidden(token_id):
            return 0
        return _num_chars(self._tokens.token_bytes(token_id))

    def _completion_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._token(entry.token_id) for entry in entries]
        offsets = []
        for entry in entries:
            offsets.append(self._text_offset)
            self._text_offset += self._num_chars(entry.token_id)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [self._top_logprobs(entry) for entry in entries],
            "text_offset": offsets,
        }

    def _top_logprobs(self, entry: TokenLogprob) -> dict[str, float]:
        """The top `logprobs` tokens and, as OpenAI's completions promise, the sampled one (up to
        logprobs + 1 entries; with logprobs 0, the sampled one alone)."""
        top = {self._token(tid): lp for tid, lp in entry.top[: self._parsed.num_top_logprobs]}
        top.setdefault(self._token(entry.token_id), entry.logprob)
        return top

    def _prompt_logprobs(self, state: ReqState) -> dict[str, Any]:
        """The echoed prompt's tokens in completions' logprobs shape; its first token has no logprob (null)."""
        pieces, offsets = self._prompt_pieces(state.prompt_token_ids)
        return {
            "tokens": [self._token(t) for t in state.prompt_token_ids] if self._parsed.tokens_as_ids
            else [_shown(piece) for piece in pieces],
            "token_logprobs": [None, *(entry.logprob for entry in state.prompt_logprobs)],
            "top_logprobs": [None, *(self._top_logprobs(entry) for entry in state.prompt_logprobs)],
            "text_offset": offsets,
        }

    def _prompt_pieces(self, token_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """Each prompt token's piece and where it starts in the echoed text. A special token the text
        leaves out (the BOS a text prompt gets) takes no room in it, and the first token the text
        shows is written as the text begins."""
        pieces, offsets, offset, has_started = [], [], 0, False
        for token_id in token_ids:
            piece = self._tokens.token_bytes(token_id)
            is_shown = not self._tokens.is_hidden(token_id) or \
                self._echo_text.startswith(piece.decode(errors="replace"), offset)
            if is_shown and not has_started:  # (a lone "▁" first adds nothing; the word after it keeps its space)
                piece, has_started = self._first_piece(token_id), True
            pieces.append(piece)
            offsets.append(offset)
            offset += _num_chars(piece) if is_shown else 0
        return pieces, offsets

    def _first_piece(self, token_id: int) -> bytes:
        """A prompt's first token, at the start of the text: alone (no "▁word" space before it)."""
        text = self._tokens.token_text(token_id)
        return self._tokens.token_bytes(token_id) if "\ufffd" in text else text.encode()

    def _vllm_prompt_logprobs(self, state: ReqState) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
        decoded_token}} of the prompt token and the top k at its position."""
        return [None, *(self._vllm_logprob_entry(entry) for entry in state.prompt_logprobs)]

    def _vllm_logprob_entry(self, entry: TokenLogprob) -> dict[str, dict[str, Any]]:
        candidates = [(entry.token_id, entry.logprob, entry.rank)]
        candidates += [(token_id, logprob, rank) for rank, (token_id, logprob)
                       in enumerate(entry.top[: self._parsed.prompt_logprobs], start=1)]
        by_id: dict[str, dict[str, Any]] = {}
        for token_id, logprob, rank in candidates:
            by_id.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                             "decoded_token": self._tokens.token_bytes(token_id).decode(
                                                 errors="replace")})
        return by_id


def _shown(piece: bytes) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


def _num_chars(piece: bytes) -> int:
    return sum(1 for byte in piece if byte & 0xC0 != 0x80)


def _joined(prompt: dict[str, list], output: dict[str, list] | None) -> dict[str, list]:
    """Completions logprobs of the echoed prompt followed by the output's."""
    return {key: values + (output or {}).get(key, []) for key, values in prompt.items()}
