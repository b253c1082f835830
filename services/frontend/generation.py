"""Domain types of one generation as the frontend sees it: what it asks an instance for and
what comes back. No transport here; convert.py maps them to and from ferry.v1 protos."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

RequestId = NewType("RequestId", str)
InstanceId = NewType("InstanceId", str)


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # aborted by an operator (a client that left never reads it)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters after validation (ranges hold; see openai_protocol)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # uint64
    max_tokens: int | None = None  # None until the prompt is tokenized: then the rest of the context
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: finish after any of these (kept in token_ids, not the text)
    ignore_eos: bool = False
    num_logprobs: int = 0  # what the engine computes: chosen token + top n (0 = off)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    repetition_penalty: float = 1.0  # (0, 2]
    min_p: float = 0.0  # [0, 1]
    cache_salt: str = ""  # prefix caching: only requests with the same salt share cached blocks
    num_prompt_logprobs: int | None = None  # completions echo + logprobs: each prompt token's, plus the top n
    min_tokens: int = 0  # vLLM's: no eos, stop token id or stop string ends the output before this many tokens
    grammar: str = ""  # constrained decoding: an llguidance grammar (see structured_output); "" = off


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """One request as sent to an instance; `resume_token_ids` grow across a resume."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    priority: int = 0
    resume_token_ids: tuple[int, ...] = ()
    resume_text: str = ""  # the text of resume_token_ids the client has (a held-back tail is not in it)
    resume_first_start: int | None = None  # where the failed instance first computed the prompt from, if it said
    # For the manager's `prefix` policy, not the instance: chained hashes of the prompt's chunks
    # (prefix_hash.prefix_chunk_keys). Of the prompt only, also on a resume: that is what instances cache.
    prefix_chunk_keys: tuple[int, ...] = ()
    attempt: int = 0  # this frontend's try at the request: 1 for its first Generate, one more per Generate after it


@dataclass(frozen=True, slots=True)
class CopyRef:
    """The copy of a request an Abort ends: the attempt whose Generate began it, and its owner epoch. An instance
    holding a newer copy (a resume there, a hand-off back there) leaves it alone when the Abort lands late."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first
    rank: int = 1  # 1 + how many tokens were more likely than token_id


@dataclass(frozen=True, slots=True)
class Handoff:
    """The request moved (live migration): continue its stream with Attach on the destination."""

    dst_instance_id: InstanceId
    dst_address: str
    epoch: int  # the request's owner epoch on the destination
    next_token_index: int  # the first token index the destination streams


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One GenerateChunk: tokens `token_index .. token_index + len(token_ids)` of the output."""

    token_index: int
    token_ids: tuple[int, ...]
    text: str  # detokenized delta, as the instance produced it
    finish_reason: FinishReason | None
    epoch: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    num_prompt_tokens: int = 0  # set on the first chunk
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with num_prompt_logprobs, on token 0's: prompt tokens 1..
    handoff: Handoff | None = None  # set on the last chunk of a stream whose request moved away
    first_start: int | None = None  # where the instance first computed the prompt from (a resume sends it back)


@dataclass(frozen=True, slots=True)
class Declined:
    """The manager answered Dispatch with no instance (none serves besides those excluded)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request runs."""

    instance_id: InstanceId
    address: str
    can_prefill_on_decode: bool = False  # a DECODE instance chosen on purpose (no prefill instance serves)
