"""A request as the engine sees it: what was asked (`SamplingParams`) and how far it got (`Request`).

Token numbering: a request's context is `prompt_token_ids + output_token_ids`.
`output_token_ids` starts with the `resume_token_ids` a request was added with
(tokens another instance generated before it died), so output index i is the
same on every instance the request ever ran on, and `max_tokens` counts them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from services.common.errors import InvalidArgument
from services.common.prefix_hash import MAX_CACHE_SALT_CHARS, BlockHash, next_block_hash
from services.instance.engine.block_manager import BlockId
from services.instance.engine.context_window import OVER_CONTEXT
from services.instance.engine.guided import Guide
from services.instance.engine.logprobs import TokenLogprob
from services.instance.engine.text_output import TextOutput

RequestId = NewType("RequestId", str)

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_PENALTY = 2.0
# vLLM's _SAMPLING_EPS: a temperature below it samples greedily. Dividing logits by a tinier one
# overflows to infinity (1e-38 made every probability NaN and every token id 0).
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 2.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue; holds no KV blocks
    RUNNING = "running"  # in the running batch; holds the blocks in its block table
    SUSPENDED = "suspended"  # out of the batch while it migrates; keeps its blocks (none if it was waiting)
    FINISHED = "finished"  # done; its blocks are back in the free list


class RequestOrigin(enum.Enum):
    """How a request came to this engine (ListRequests: the manager tells a migration's commit from a resume)."""

    DISPATCHED = "dispatched"  # add_request
    RESUMED = "resumed"  # add_request with resumed tokens (the frontend's failover)
    MIGRATED_IN = "migrated_in"  # import_request (a committed migration in)


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, the model's context, or more KV blocks than the cache has
    ABORT = "abort"  # aborted by the client or an operator


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) = greedy
    top_p: float = 1.0  # (0, 1]: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 = off; otherwise keep the k most likely tokens
    seed: int | None = None  # same seed, same tokens, whatever the batch; None = drawn at admission
    max_tokens: int = 16  # most output tokens, resumed ones included
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # finish after any of these (kept in the token ids, not the text)
    ignore_eos: bool = False  # keep going after the model's eos tokens
    logprobs: int = 0  # 0 = off; n = logprob of the chosen token plus the top n
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is already in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    repetition_penalty: float = 1.0  # > 1 discourages every prompt and output token: logit / p if > 0, else * p
    min_p: float = 0.0  # sampling: drop tokens with probability below min_p times the top token's
    cache_salt: str = ""  # prefix caching, not sampling: only requests with the same salt share cached blocks
    prompt_logprobs: int | None = None  # None = off; n = each prompt token's logprob plus the top n (see Request)
    min_tokens: int = 0  # output tokens before eos, stop_token_ids or a stop string may end it (resumed ones count)
    grammar: str = ""  # constrained decoding: an llguidance grammar (services.instance.engine.guided); "" = off

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def validate(self, max_model_len: int, num_prompt_tokens: int) -> None:
        """Raise `InvalidArgument` naming the first field that cannot be served."""
        if num_prompt_tokens <= 0:
            raise InvalidArgument("prompt_token_ids: the prompt is empty; send at least one token")
        if num_prompt_tokens > max_model_len:
            raise InvalidArgument(
                f"prompt_token_ids: the prompt has {num_prompt_tokens} tokens, {OVER_CONTEXT} of {max_model_len} "
                "(max_model_len); shorten the prompt"
            )
        if self.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: must be positive, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0.0:
            raise InvalidArgument(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}] or unset, got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed: must be in [0, 2**64 - 1], got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop: stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidArgument(f"{name}: must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgument(f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY}], got "
                                  f"{self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p: must be in [0, 1], got {self.min_p}")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgument(f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(self.cache_salt)}")
        for token_id, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidArgument(f"logit_bias: the bias of token {token_id} must be in "
                                      f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}")


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one request; owned and mutated by the engine thread only."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int  # effective seed: sampling.seed, or drawn at admission so the request can move
    arrival_order: int  # engine-wide admission counter; earlier wins ties in priority
    text: TextOutput  # detokenizer state, stop strings and what text was already emitted
    priority: int = 0  # higher is admitted first and preempted last
    epoch: int = 0  # owner epoch: 0 where the request started, one more per migration
    num_resumed_tokens: int = 0  # leading output tokens that came with the request (failover)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Invariant: while RUNNING or SUSPENDED, block_table covers at least num_computed_tokens
    # tokens; while WAITING or FINISHED it is empty and num_computed_tokens is 0.
    block_table: list[BlockId] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    # Where its prompt was first computed from here (the cached tokens it was first admitted with): a
    # preemption's recompute starts there again, so its prompt is cut where it was. None until admitted.
    first_start: int | None = None
    num_registered_blocks: int = 0  # leading blocks of block_table the prefix cache knows (or was asked to)
    # Leading entries of block_table given back out of the sliding window (block_manager.py): placeholders,
    # held by nobody for this request, never read again. Only grows while it holds blocks; 0 once it holds none.
    num_dropped_blocks: int = 0
    # Its first computed block whose hash another block held when it registered (the same tokens computed by
    # another request: a greedy n > 1 sibling, say, whose rows may have other bits). A recompute starts from
    # no cached block from there on, ever (the other's may be back there), so it goes on with its own bits.
    # None: every block registered as its own.
    first_foreign_block: int | None = None
    # sampling.prompt_logprobs: entry i is prompt token i + 1's, filled as prefill chunks run and
    # sent with output token 0. A preemption's recompute does not redo what is here.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    _block_hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks, grown lazily
    guide: Guide | None = None  # sampling.grammar's state past output_token_ids (constrained decoding)
    origin: RequestOrigin = RequestOrigin.DISPATCHED
    migrated_from: str = ""  # with MIGRATED_IN: the instance id of the migration's source
    # MIGRATED_IN: the migration that brought it here; RESUMED: the migration whose committed copy, which no client
    # attached to, this resume replaced (its hand-off never reached the client)
    migration_id: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prefill must produce logits for every prompt position (and so cannot start from cached blocks):
        prompt logprobs were asked for and not sent yet. They go out with output token 0, so a request that has
        output tokens (generated here, resumed, or migrated in) never wants them."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Context tokens [start, stop) of prompt + output, without copying the whole context."""
        num_prompt = len(self.prompt_token_ids)
        head = list(self.prompt_token_ids[start:min(stop, num_prompt)]) if start < num_prompt else []
        tail = self.output_token_ids[max(start - num_prompt, 0):max(stop - num_prompt, 0)]
        return head + tail

    def block_hashes(self, block_size: int, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the context's first `num_blocks` blocks (full ones only)."""
        num_blocks = min(num_blocks, self.num_tokens // block_size)
        hashes = self._block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(next_block_hash(hashes, self.token_ids(i * block_size, (i + 1) * block_size),
                                          self.sampling.cache_salt))
        return hashes[:num_blocks]
