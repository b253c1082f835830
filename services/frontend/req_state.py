"""Per-request state in the frontend (SGLang's `ReqState`): the instance stream feeds it, the
HTTP handler drains it.

Tokens are keyed by their index in the output. `token_ids` only ever grows, and a token
index is accepted once: a chunk (or the part of one) below what we hold is a repeat from
a resumed or handed-off stream and is dropped; a chunk above it is a gap, which the
stream that sent it must not be trusted with (`StreamGap`). So a resume that sends
`resume_token_ids = token_ids` continues with no token lost and none repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from services.common.errors import FerryError, Unavailable
from services.frontend.generation import FinishReason, RequestId, TokenChunk, TokenLogprob
from services.frontend.shown_markers import MarkerPlacer

Decode = Callable[[Sequence[int]], str]


class StreamGap(Unavailable):
    """A chunk skipped token indexes: the stream is broken; resume from what we hold."""


@dataclass(frozen=True, slots=True)
class Delta:
    """What is new for the client since the last delta."""

    token_index: int  # index of token_ids[0] in the output
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None


class ReqState:
    def __init__(self, request_id: RequestId, prompt_token_ids: Sequence[int], decode: Decode,
                 markers: MarkerPlacer | None = None) -> None:
        """`markers`: puts special tokens back into `text` for a tool-call parser (shown_markers.py)."""
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.token_ids: list[int] = []  # invariant: token_ids[i] is output token i; never shrinks
        # Text of token_ids as streamed to the client, and the instance's text of them (without markers: what a
        # resume sends back), in pieces joined when read (`text`, `plain_text`): growing one string per token
        # copied it whole each time, quadratic in the output (11 s of CPU for 128k tokens).
        self._text = _Pieces()
        self._plain_text = _Pieces()
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. (echo + logprobs), with token 0
        self.finish_reason: FinishReason | None = None
        self.error: FerryError | None = None  # set once; ends the stream
        self.num_resumes = 0
        self.num_handoffs = 0  # live migrations followed
        self.first_start: int | None = None  # where the prompt was first computed from, once an instance said
        self._decode = decode
        self._markers = markers
        self._pending: list[Delta] = []
        self._event = asyncio.Event()

    @property
    def text(self) -> str:
        return self._text.joined()

    @property
    def plain_text(self) -> str:
        return self._plain_text.joined()

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def accept(self, chunk: TokenChunk) -> Delta | None:
        """Take the new part of `chunk`; None if it held nothing new."""
        if self.is_done:
            return None
        if chunk.first_start is not None and self.first_start is None:
            self.first_start = chunk.first_start  # kept from the first instance that computed the prompt
        have = len(self.token_ids)
        if chunk.token_index > have:
            raise StreamGap(f"request {self.request_id}: chunk starts at token {chunk.token_index}, "
                            f"but only {have} tokens arrived")
        skip = have - chunk.token_index
        new_ids = chunk.token_ids[skip:] if skip < len(chunk.token_ids) else ()
        if not new_ids and chunk.finish_reason is None:
            return None
        plain = chunk.text if skip == 0 else self._text_of(new_ids)
        text = plain if self._markers is None else self._markers.place(self.token_ids, new_ids, plain)
        delta = Delta(have, tuple(new_ids), text, tuple(chunk.logprobs[skip:]), chunk.finish_reason)
        if have == 0 and chunk.token_index == 0:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.token_ids.extend(new_ids)
        self._text.append(text)
        self._plain_text.append(plain)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = chunk.finish_reason
        self._publish(delta)
        return delta

    def fail(self, error: FerryError) -> None:
        if not self.is_done:
            self.error = error
            self._event.set()

    async def deltas(self) -> AsyncIterator[Delta]:
        """New deltas as they arrive; ends after the finishing delta, raises the error on failure."""
        while True:
            await self._event.wait()
            self._event.clear()
            pending, self._pending = self._pending, []
            for delta in pending:
                yield delta
            if self._pending:
                continue  # published while the consumer held the last ones: before the end or the error
            if self.finish_reason is not None:
                return
            if self.error is not None:
                raise self.error

    def _text_of(self, new_ids: Sequence[int]) -> str:
        """Text of `new_ids` after what we hold (used when a chunk overlapped what we had)."""
        before = self._decode(self.token_ids)
        return self._decode([*self.token_ids, *new_ids])[len(before):]

    def _publish(self, delta: Delta) -> None:
        self._pending.append(delta)
        self._event.set()


class _Pieces:
    """A string grown piece by piece: appending is O(piece), reading joins what was appended since the last read."""

    __slots__ = ("_pieces",)

    def __init__(self) -> None:
        self._pieces: list[str] = []

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)

    def joined(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
