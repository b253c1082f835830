"""What live migration reads from and hands between engines (README "Live migration").

* `MigrationBlocks`: where a request's K/V live on the source at one step boundary. The
  leading `num_full_blocks` blocks never change again while the request keeps its blocks,
  so they can be copied while it decodes; a preemption (`num_preemptions` moves) frees
  them, and every copy made before is void.
* `RequestState`: everything the destination needs to continue the request exactly as
  the source would have: tokens, sampling params and effective seed (the sampler's
  randomness for output token i depends only on (seed, i)), how many tokens' K/V were
  copied, how much text the client already has, and where its prompt was first computed
  from (a recompute after a preemption on the destination cuts the prompt there again).
* `imported_request`: the request a `RequestState` becomes on its destination.
* `pick_request`: which request a source moves when it is not told; `check_movable`: whether the one it
  is told can move now.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.common.prefix_hash import BlockHash
from services.instance.engine.block_manager import BlockId, num_blocks_for
from services.instance.engine.guided import Guide
from services.instance.engine.request import Request, RequestId, RequestOrigin, RequestStatus, SamplingParams
from services.instance.engine.text_output import TextOutput


class MigrationSelection(enum.Enum):
    # cheapest to move: a queued request while the batch is full (no copy, no pause), else the fewest tokens
    SHORTEST_RUNNING = "shortest_running"
    LONGEST_RUNNING = "longest_running"  # most tokens: frees the most blocks
    LAST_COME_FIRST = "last_come_first"  # the latest admitted
    PREFILL_DONE = "prefill_done"  # only decoding requests, oldest first: the PD hand-off to a decode instance


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request parked for its PD hand-off, with what the hand-off needs, taken in the engine
    step that parked it (nothing changes while it is parked, so no later engine call is needed)."""

    blocks: "MigrationBlocks"
    state: "RequestState"
    held_at: float  # time.perf_counter() when it left the batch


@dataclass(frozen=True, slots=True)
class MigrationBlocks:
    request_id: RequestId
    status: RequestStatus
    block_ids: tuple[BlockId, ...]  # the blocks holding computed tokens, in block-table order
    num_full_blocks: int  # leading blocks whose every token is computed: final while the blocks are held
    num_computed_tokens: int
    num_preemptions: int  # changes when a preemption freed the blocks
    max_num_blocks: int  # blocks the request can grow to (prompt + max_tokens, within max_model_len)
    block_hashes: tuple[BlockHash, ...] = ()  # chained hashes of the full blocks (a destination's prefix cache)
    max_num_tokens: int = 0  # tokens the request can grow to (prompt + max_tokens, within max_model_len)
    # Leading block_ids given back out of the sliding window (placeholders, block_manager.py): never copied; the
    # destination, reading the same window, gives back at least these as it imports the request.
    num_dropped_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class RequestState:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # generated so far, resumed ones included
    sampling: SamplingParams
    seed: int  # effective seed
    priority: int
    epoch: int  # the new owner's epoch
    num_computed_tokens: int  # tokens whose K/V are in the copied blocks (0: it was waiting)
    text_sent: str  # output text already handed to the client
    num_resumed_tokens: int
    first_start: int | None = None  # Request.first_start: where its prompt was first computed from; None: unknown
    max_num_tokens: int = 0  # prompt + max_tokens within the source's max_model_len; 0: not known

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def max_num_tokens_of(request: Request, max_model_len: int) -> int:
    """The tokens `request` can grow to here (prompt + max_tokens, within `max_model_len`): what a
    destination checks against its own max_model_len (`check_serves_length`)."""
    return min(request.num_prompt_tokens + request.sampling.max_tokens, max_model_len)


def migration_blocks(request: Request, block_size: int, max_model_len: int) -> MigrationBlocks:
    num_computed = request.num_computed_tokens
    max_num_tokens = max_num_tokens_of(request, max_model_len)
    return MigrationBlocks(
        request_id=request.request_id, status=request.status,
        block_ids=tuple(request.block_table[:num_blocks_for(num_computed, block_size)]),
        num_full_blocks=num_computed // block_size, num_computed_tokens=num_computed,
        num_preemptions=request.num_preemptions, max_num_blocks=num_blocks_for(max_num_tokens, block_size),
        block_hashes=tuple(request.block_hashes(block_size, num_computed // block_size)),
        max_num_tokens=max_num_tokens, num_dropped_blocks=request.num_dropped_blocks,
    )  # fmt: skip


def export_state(request: Request, max_model_len: int) -> RequestState:
    """The state of a suspended request, for its next owner (epoch + 1)."""
    return RequestState(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        output_token_ids=tuple(request.output_token_ids), sampling=request.sampling, seed=request.seed,
        priority=request.priority, epoch=request.epoch + 1, num_computed_tokens=request.num_computed_tokens,
        text_sent=request.text.text[:request.text.num_emitted_chars], num_resumed_tokens=request.num_resumed_tokens,
        first_start=request.first_start,
        max_num_tokens=max_num_tokens_of(request, max_model_len),
    )  # fmt: skip


def imported_request(state: RequestState, *, text: TextOutput, guide: Guide | None, block_table: list[BlockId],
                     arrival_order: int, src_instance_id: str, migration_id: str) -> Request:
    """The request `export_state` exported, on its new owner, its first `state.num_computed_tokens`
    tokens' K/V in `block_table` (copied from `src_instance_id` by migration `migration_id`)."""
    return Request(
        request_id=state.request_id, prompt_token_ids=state.prompt_token_ids, sampling=state.sampling,
        seed=state.seed, arrival_order=arrival_order, text=text, priority=state.priority,
        epoch=state.epoch, num_resumed_tokens=state.num_resumed_tokens,
        output_token_ids=list(state.output_token_ids), block_table=block_table,
        num_computed_tokens=state.num_computed_tokens, guide=guide, first_start=state.first_start,
        origin=RequestOrigin.MIGRATED_IN, migrated_from=src_instance_id, migration_id=migration_id,
    )  # fmt: skip


def is_prefill_done(request: Request) -> bool:
    """Decoding: running, prompt computed, at least one output token."""
    return (request.status is RequestStatus.RUNNING and request.num_output_tokens >= 1
            and request.num_uncomputed_tokens <= 1)


def is_movable(request: Request) -> bool:
    """Decoding (prompt computed, at least one output token) or still waiting."""
    return request.status is RequestStatus.WAITING or is_prefill_done(request)


def check_movable(request: Request) -> None:
    """FailedPrecondition while its prompt is partly computed (a chunked prefill) or its context is computed
    again after a preemption: what it computed so far of its prompt's logprobs does not travel, and a moment
    later it can move. A suspended (migrating or held) request passes."""
    if request.status is RequestStatus.SUSPENDED or is_movable(request):
        return
    if request.output_token_ids:  # preempted, and its context is being computed again
        raise FailedPrecondition(
            f"request {request.request_id} is recomputing its context after a preemption "
            f"({request.num_computed_tokens} of {request.num_tokens} tokens computed); it can migrate once that is done")
    raise FailedPrecondition(
        f"request {request.request_id} is prefilling ({request.num_computed_tokens} of {request.num_prompt_tokens} "
        "prompt tokens computed); it can migrate while queued or once it has its first token")


def pick_request(requests: Iterable[Request], selection: MigrationSelection,
                 exclude: frozenset[str] = frozenset(), is_batch_full: bool = False) -> Request | None:
    """The request `selection` moves: of the lowest priority present (a higher-priority request is
    paused and moved last), a decoding one, or a waiting one if none decodes. Except that
    SHORTEST_RUNNING, the cheapest move, takes the oldest waiting one while the batch is full
    (`is_batch_full`: every slot running, migrating or held for a migration in): it needs no KV copy
    and no pause, starts on the destination (which reserves it a slot) instead of waiting here for
    one, and cannot be admitted here meanwhile (which would fail its move)."""
    movable = [r for r in requests if r.request_id not in exclude and is_movable(r)]
    if selection is MigrationSelection.PREFILL_DONE:  # never a waiting one: it would prefill on the destination
        return min((r for r in movable if is_prefill_done(r)), key=lambda r: r.arrival_order, default=None)
    if not movable:
        return None
    lowest = min(r.priority for r in movable)
    movable = [r for r in movable if r.priority == lowest]
    waiting = [r for r in movable if r.status is RequestStatus.WAITING]
    if selection is MigrationSelection.SHORTEST_RUNNING and is_batch_full and waiting:
        return min(waiting, key=lambda r: r.arrival_order)
    candidates = [r for r in movable if r.status is RequestStatus.RUNNING] or movable
    if selection is MigrationSelection.LAST_COME_FIRST:
        return max(candidates, key=lambda r: r.arrival_order)
    if selection is MigrationSelection.LONGEST_RUNNING:
        return max(candidates, key=lambda r: (r.num_tokens, -r.arrival_order))
    return min(candidates, key=lambda r: (r.num_tokens, r.arrival_order))


def check_serves_length(request_id: str, max_num_tokens: int, max_model_len: int) -> None:
    """ResourceExhausted where a migrating request may reach more tokens (`max_num_tokens`, prompt + max_tokens
    on its source; 0: not known) than this destination serves: here it would end early with LENGTH."""
    if max_num_tokens > max_model_len:
        raise ResourceExhausted(
            f"request {request_id} may reach {max_num_tokens} tokens (prompt + max_tokens) on its source, but "
            f"this instance serves at most {max_model_len} (max_model_len); pick another destination")
