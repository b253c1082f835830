"""Small factories and fakes for frontend unit tests (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence

from services.common.errors import FerryError, Unavailable
from services.frontend.dispatch import InstanceEntry
from services.frontend.generation import (CopyRef, FinishReason, GenerateSpec, Handoff, InstanceId, RequestId, Sampling,
                                          Target, TokenChunk)
from services.frontend.req_state import ReqState


def decode(ids: Sequence[int]) -> str:
    """A toy detokenizer: token i is the letter chr(ord('a') + i % 26)."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


def token_text(token_id: int) -> str:
    return decode([token_id])


class ToyTokens:
    """Logprobs' view of the toy vocabulary (`decode`), or of given token bytes; `hidden` ids are
    special tokens left out of the text."""

    def __init__(self, pieces: dict[int, bytes] | None = None, hidden: frozenset[int] = frozenset()) -> None:
        self._pieces = pieces
        self._hidden = hidden

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id] if self._pieces is not None else token_text(token_id).encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode(errors="replace").lstrip(" ")

    def is_hidden(self, token_id: int) -> bool:
        return token_id in self._hidden


TOY_TOKENS = ToyTokens()


def make_state(prompt: Sequence[int] = (1, 2, 3)) -> ReqState:
    return ReqState(RequestId("cmpl-1"), prompt, decode)


def chunk(index: int, *ids: int, finish: FinishReason | None = None, epoch: int = 0) -> TokenChunk:
    return TokenChunk(token_index=index, token_ids=ids, text=decode(ids), finish_reason=finish, epoch=epoch)


def handoff(index: int, dst: str, epoch: int, *ids: int, from_epoch: int = 0) -> TokenChunk:
    """The last chunk of a source's stream: `ids` (maybe none) then a hand-off to `dst` at `epoch`."""
    return TokenChunk(token_index=index, token_ids=ids, text=decode(ids), finish_reason=None, epoch=from_epoch,
                      handoff=Handoff(InstanceId(dst), f"addr-{dst}", epoch, index + len(ids)))


def make_spec(max_tokens: int = 8) -> GenerateSpec:
    return GenerateSpec(RequestId("cmpl-1"), (1, 2, 3), Sampling(temperature=0.0, max_tokens=max_tokens))


class FakeMembership:
    def __init__(self, *entries: InstanceEntry) -> None:
        self.entries = list(entries)

    def instances(self) -> Sequence[InstanceEntry]:
        return self.entries


def entry(instance_id: str, is_serving: bool = True) -> InstanceEntry:
    return InstanceEntry(InstanceId(instance_id), f"addr-{instance_id}", is_serving)


class FakeManager:
    def __init__(self, answer: Target | None) -> None:
        self.answer = answer
        self.calls: list[tuple[GenerateSpec, tuple[InstanceId, ...]]] = []

    async def dispatch(self, spec: GenerateSpec, exclude: Sequence[InstanceId]) -> Target | None:
        self.calls.append((spec, tuple(exclude)))
        return self.answer


Script = tuple[list[TokenChunk], FerryError | None]


class ScriptedInstances:
    """`InstanceStreams` whose streams follow a script per instance: chunks, then an optional error.

    `attach_scripts` script the Attach streams; an instance with several Attaches (A→B→A)
    gets a list, used in order.
    """

    def __init__(self, scripts: dict[str, Script], attach_scripts: dict[str, Script | list[Script]] | None = None):
        self.scripts = scripts
        self.attach_scripts = {k: v if isinstance(v, list) else [v] for k, v in (attach_scripts or {}).items()}
        self.specs: list[tuple[str, GenerateSpec]] = []
        self.attaches: list[tuple[str, RequestId, int, int]] = []  # (instance, request, from_token_index, epoch)
        self.aborted: list[tuple[str, RequestId]] = []
        self.aborted_copies: list[CopyRef | None] = []  # what each of those named

    async def generate(self, target: Target, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        self.specs.append((target.instance_id, spec))
        chunks, error = self.scripts[target.instance_id]
        for item in chunks:
            yield item
        if error is not None:
            raise error

    async def attach(self, target: Target, request_id: RequestId, from_token_index: int,
                     epoch: int) -> AsyncIterator[TokenChunk]:
        self.attaches.append((target.instance_id, request_id, from_token_index, epoch))
        chunks, error = self.attach_scripts[target.instance_id].pop(0)
        for item in chunks:
            yield item
        if error is not None:
            raise error

    def abort_soon(self, target: Target, request_id: RequestId, copy: CopyRef | None = None) -> Awaitable[None]:
        self.aborted.append((target.instance_id, request_id))
        self.aborted_copies.append(copy)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class BreaksOnce(ScriptedInstances):
    """Every instance: token 4, then its stream breaks; the next stream (a resume) ends with token 5."""

    async def generate(self, target: Target, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        self.specs.append((target.instance_id, spec))
        if len(self.specs) == 1:
            yield chunk(0, 4)
            raise Unavailable("the stream broke (the instance was killed)")
        yield chunk(1, 5, finish=FinishReason.STOP)
