"""What a request must satisfy to enter the engine: added, resumed, or imported by a migration.

Each check raises the error its caller's client should see: InvalidArgument naming the field for input
that can never run here, ResourceExhausted for what another instance (or a later try) could take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgument, ResourceExhausted
from services.instance.engine.block_manager import max_blocks_held
from services.instance.engine.migration_state import RequestState, check_serves_length
from services.instance.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """What this engine can hold: its vocabulary, context and KV cache."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    window: int | None = None  # every layer's sliding window: a request holds only its window's blocks


def check_queue_room(num_waiting: int, max_num_waiting: int) -> None:
    """A new request past the waiting-queue bound (0: none) is refused (resumed ones never are: their
    streams are already under way, and the cluster holds them anyway)."""
    if max_num_waiting and num_waiting >= max_num_waiting:
        raise ResourceExhausted(f"{num_waiting} requests are already waiting to start on this "
                                f"instance (for a batch slot or KV blocks; --max-waiting-requests {max_num_waiting}); "
                                "retry later or on another instance")


def check_tokens(prompt: Sequence[int], resumed: Sequence[int], sampling: SamplingParams, limits: TokenLimits) -> None:
    """Token ids inside the vocabulary, something left to generate, and a context that fits the cache."""
    vocab_size, max_model_len = limits.vocab_size, limits.max_model_len
    for field, ids in (("prompt_token_ids", prompt), ("resume_token_ids", resumed),
                       ("logit_bias", [t for t, _ in sampling.logit_bias]),
                       ("stop_token_ids", sampling.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if resumed and len(prompt) + len(resumed) >= max_model_len:  # the request ended there (LENGTH)
        raise InvalidArgument(
            f"resume_token_ids: prompt + resumed tokens ({len(prompt) + len(resumed)}) fill the model's "
            f"context of {max_model_len} (max_model_len); nothing is left to generate"
        )
    if len(resumed) >= sampling.max_tokens:
        raise InvalidArgument(
            f"resume_token_ids: {len(resumed)} tokens already generated, max_tokens is {sampling.max_tokens}; "
            "nothing is left to generate"
        )
    num_needed = max_blocks_held(len(prompt) + len(resumed), limits.block_size, limits.window)
    if num_needed > limits.num_blocks:
        raise ResourceExhausted(
            f"prompt needs {num_needed} KV blocks but this instance's cache has {limits.num_blocks} "
            "(--num-blocks); send it to an instance with a larger cache"
        )


def check_first_start(first_start: int | None, num_tokens: int, field: str) -> None:
    if first_start is not None and not 0 <= first_start < num_tokens:
        raise InvalidArgument(f"{field}: must be in [0, {num_tokens}) (prompt + output) or unset, got {first_start}")


def check_import(state: RequestState, limits: TokenLimits) -> None:
    """A migrating request's state, checked as its destination adopts it (a duplicate id is the engine's to see)."""
    state.sampling.validate(limits.max_model_len, len(state.prompt_token_ids))
    check_serves_length(state.request_id, state.max_num_tokens, limits.max_model_len)
    check_tokens(state.prompt_token_ids, list(state.output_token_ids), state.sampling, limits)
    if not 0 <= state.num_computed_tokens < state.num_tokens:
        raise InvalidArgument(f"num_computed_tokens: must be in [0, {state.num_tokens}) (prompt + output), "
                              f"got {state.num_computed_tokens}")
    check_first_start(state.first_start, state.num_tokens, field="first_start")
