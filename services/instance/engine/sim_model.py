"""The model of the `sim` engine: a latency model in place of the forward pass.

Everything else is the real engine: scheduler, paged KV cache, sampler, export/import
for migration. So a cluster of sim instances exercises dispatch, migration,
PD hand-offs and failover as a real one does, while each instance needs no weights and
almost no CPU: many of them fit on one machine (policy experiments, load tests).

A step takes what the latency model says the real forward pass would (it sleeps the
rest, releasing the GIL):

    step_ms + prefill_ms_per_token × prefill tokens + decode_ms_per_seq × decoding sequences

The defaults are roughly a 7B model in fp16 on one datacenter GPU; give your own from a
profile of your deployment.

The tokens come from the KV cache, so migration is checked as with the torch engine. Each
new token writes its id into its KV slot (layer 0, K, head 0, elements 0-2: three bytes
of the id, exact in every KV dtype), and the next token of a sequence is a hash of every
id in its cache with its position (with a sliding window on every layer, of the ids in
the window only, as the blocks behind it are given back). A request whose blocks were lost or garbled in a move
continues with other tokens than one that never moved; with greedy sampling a request's
tokens depend only on its prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.config import check_non_negative
from services.instance.engine.context_window import kv_window
from services.instance.engine.forward_batch import ForwardBatch
from services.instance.engine.model_config import ModelConfig

MAX_VOCAB = 1 << 24  # ids travel as three bytes
ID_BYTES = 3
PEAK_LOGIT = 20.0  # the hashed token's logit; every other token's is 0
_PRIME = 2**31 - 1
_MAX_WEIGHT = 1 << 20  # position weights: id (< 2**24) × weight, summed over 2**17 positions, fits in int64


@dataclass(frozen=True, slots=True)
class SimLatency:
    step_ms: float = 8.0  # every step, whatever it runs
    prefill_ms_per_token: float = 0.06  # each prompt token a step computes (chunks of more than one token)
    decode_ms_per_seq: float = 0.08  # each sequence that decodes one token in the step

    def __post_init__(self) -> None:
        check_non_negative(self, ("step_ms", "prefill_ms_per_token", "decode_ms_per_seq"), flag_prefix="--sim-")

    def step_s(self, batch: ForwardBatch) -> float:
        num_prefill_tokens = sum(n for n in batch.query_lens if n > 1)
        num_decodes = sum(1 for n in batch.query_lens if n == 1)
        return (self.step_ms + self.prefill_ms_per_token * num_prefill_tokens
                + self.decode_ms_per_seq * num_decodes) / 1000


class SimModel:
    """`model(batch, kv_cache)` → float32 logits [num_seqs, vocab], like `LlamaModel`."""

    def __init__(self, config: ModelConfig, latency: SimLatency = SimLatency(),
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if config.vocab_size > MAX_VOCAB:
            raise ValueError(f"config.json: vocab_size={config.vocab_size} is above what the sim engine "
                             f"encodes in the KV cache ({MAX_VOCAB})")
        if config.head_dim < ID_BYTES:
            raise ValueError(f"config.json: head_dim={config.head_dim}; the sim engine needs at least {ID_BYTES}")
        self.config = config
        self.window = kv_window(config.layer_windows)  # None: every token of the context counts
        self.latency = latency
        self._sleep = sleep

    def __call__(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        marks = kv_cache[0, 0].view(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:, 0]  # [slots, head_dim]
        _write_ids(marks, batch.slot_mapping, batch.input_ids)
        rows, context_lens = _logit_contexts(batch)
        next_ids = self._next_ids(marks, batch.block_tables[rows], context_lens, block_size=kv_cache.shape[3])
        logits = torch.zeros(len(rows), self.config.vocab_size)
        logits[torch.arange(len(rows)), next_ids] = PEAK_LOGIT
        self._sleep(max(0.0, self.latency.step_s(batch) - (time.perf_counter() - started)))
        return logits

    def _next_ids(self, marks: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  block_size: int) -> torch.Tensor:
        """Per row: hash of (position, id) over the first `context_lens` tokens in its blocks, as a token id."""
        positions = torch.arange(int(context_lens.max()))
        blocks = block_tables.gather(1, (positions // block_size).expand(len(block_tables), -1)
                                     .clamp(max=block_tables.shape[1] - 1))
        slots = blocks * block_size + positions % block_size
        ids = _read_ids(marks, slots)
        ids = ids.masked_fill(positions >= context_lens[:, None], 0)
        if self.window is not None:  # as attention through the window: the query at context_len - 1 sees W keys
            ids = ids.masked_fill(positions < context_lens[:, None] - self.window, 0)
        digest = (ids * _position_weights(positions)).sum(dim=1) + context_lens
        return _mix(digest) % self.config.vocab_size


def _logit_contexts(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For each logits row (`batch.logit_indices()` order): its sequence, and the context length whose next
    token it predicts (the sequence's full context for its last row, one less per row before)."""
    num_logits = torch.tensor(batch.num_logits, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(batch.num_seqs), num_logits)
    ends = torch.cumsum(num_logits, 0)
    rows_after = ends[rows] - 1 - torch.arange(len(rows))  # 0 for a sequence's last row
    return rows, batch.context_lens[rows] - rows_after


def _position_weights(positions: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random weight in [1, 2**20) per position (Knuth's multiplicative hash)."""
    return (positions + 1) * 2654435761 % (_MAX_WEIGHT - 1) + 1


def _mix(digest: torch.Tensor) -> torch.Tensor:
    """Scramble the whole digest before it is cut to a token id, so two sequences that meet
    at one token (same id, same position) part again at the next."""
    h = digest % _PRIME * 48271 % _PRIME
    return (h ^ (h >> 13)) * 16807 % _PRIME


def _write_ids(marks: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
    for byte in range(ID_BYTES):
        marks[slots, byte] = ((ids >> (8 * byte)) & 0xFF).to(marks.dtype)


def _read_ids(marks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    ids = torch.zeros(slots.shape, dtype=torch.int64)
    for byte in range(ID_BYTES):
        ids |= marks[slots, byte].to(torch.int64) << (8 * byte)
    return ids
