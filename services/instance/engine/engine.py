"""The inference engine as plain logic: requests in, one step at a time, tokens out.

No threads, no asyncio, no gRPC: `EngineRunner` drives it from one thread. A step is

    schedule (which requests, how many tokens)  →  run the model  →  sample and finish requests

A request finishes on eos (unless `ignore_eos`), a stop token id, a stop string (the
text ends before it), `max_tokens` (resumed tokens included) or the model's context
(`max_model_len`). Finished and aborted requests free their KV blocks at once and
leave the engine.

Live migration (README "Live migration"), all between two steps:

    source:       pick_for_migration → migration_blocks (copy full blocks while it decodes)
                  → suspend → export_state → release (moved) | resume (migration failed)
    PD hand-off:  hold (parked right after its first token) → suspend_held → export_state → release | resume
    destination:  reserve_blocks (grows; keep_cached_reserved) → import_request | free_reservation

This module keeps the request table and the order of things; the rest lives beside it: engine_config.py
(configuration), admission_checks.py (what may enter), request_text.py (a request's text on entry),
engine_step.py (one step), finish_rules.py (when a request stops), step_output.py (what a step says of it),
migration_state.py (what a migration reads and hands over), engine_reports.py (load and ListRequests).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Sequence

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.prefix_hash import BlockHash
from services.instance.engine.admission_checks import (
    TokenLimits,
    check_first_start,
    check_import,
    check_queue_room,
    check_tokens,
)
from services.instance.engine.block_manager import BlockId, BlockManager, num_blocks_for, num_blocks_out_of_window
from services.instance.engine.context_window import kv_window
from services.instance.engine.engine_config import EngineConfig, check_geometry
from services.instance.engine.engine_reports import LoadSnapshot, RequestSnapshot, load_snapshot, request_snapshot
from services.instance.engine.engine_step import StepRunner
from services.instance.engine.forward_batch import ForwardModel
from services.instance.engine.guided import GrammarCompiler, Guide
from services.instance.engine.kv_cache import KvCache
from services.instance.engine.migration_state import (
    HeldRequest,
    MigrationBlocks,
    MigrationSelection,
    RequestState,
    check_movable,
    export_state,
    imported_request,
    is_prefill_done,
    max_num_tokens_of,
    migration_blocks,
    pick_request,
)
from services.instance.engine.prefix_cache import NO_PREFIX_CACHE_STATS, PrefixCacheStats
from services.instance.engine.prompt_logprobs import PROMPT_LOGITS_BUDGET
from services.instance.engine.request import (
    FinishReason,
    Request,
    RequestId,
    RequestOrigin,
    RequestStatus,
    SamplingParams,
)
from services.instance.engine.reservations import MigrationId, Reservations
from services.instance.engine.scheduler import Scheduler
from services.instance.engine.step_output import StepOutput, step_output
from services.instance.engine.request_text import migrated_text, resumed_text
from services.instance.engine.text_output import TextOutput
from services.instance.engine.tokenizer import Tokenizer
from services.transfer.block_copy import kv_rows
from services.transfer.checksum import block_checksums


class LLMEngine:
    def __init__(self, model: ForwardModel, tokenizer: Tokenizer, kv_cache: KvCache, config: EngineConfig) -> None:
        check_geometry(config, kv_cache)
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.config = config
        window = kv_window(model.config.layer_windows)  # blocks behind it go back (block_manager.py)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching, window)
        self.reservations = Reservations(self.block_manager)  # blocks (and a batch slot each) held for requests migrating in
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_prompt_logit_rows=PROMPT_LOGITS_BUDGET // model.config.vocab_size,
                                   num_reserved_slots=lambda: len(self.reservations),
                                   recomputes_one_by_one=kv_cache.tensor.device.type == "cpu",
                                   prefill_chunk_tokens=config.prefill_chunk_tokens)
        self.vocab_size: int = model.config.vocab_size
        eos_token_ids = frozenset(model.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer.backend, self.vocab_size, eos_token_ids)
        self._limits = TokenLimits(self.vocab_size, config.max_model_len, config.block_size, config.num_blocks, window)
        self._requests: dict[RequestId, Request] = {}  # waiting + running + suspended; finished ones leave at once
        self._arrivals = itertools.count()
        self._steps = StepRunner(model, kv_cache, self.scheduler, eos_token_ids, config.max_model_len,
                                 forget=self._forget)
        self.num_requests_admitted = 0  # requests added since start (Generate)
        self.num_requests_migrated_in = 0  # requests imported since start (committed migrations in)

    # Requests in and out.

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    priority: int = 0, resume_token_ids: Sequence[int] = (), resume_text: str | None = None,
                    guide: Guide | None = None, first_start: int | None = None,
                    replaced_migration_id: str = "") -> None:
        """Queue a request; raises InvalidArgument (bad input, duplicate id) or ResourceExhausted.
        A resume (`resume_token_ids`) goes on after `resume_text`, the part of their text the client
        has; None counts all of it as sent, and its prompt is cut at `first_start` (where it was first
        computed from on the instance that failed), so its rows get the bits they had there. A request
        with a grammar takes `guide` if given (built off the engine thread with `new_guide`), else builds it here.
        A resume that replaced the copy a migration committed here, which no client attached to (its hand-off
        never reached the client), keeps `replaced_migration_id` (ListRequests: that migration did commit)."""
        request_id = RequestId(request_id)
        if request_id in self._requests:
            raise InvalidArgument(f"request_id: {request_id!r} is already on this instance; ids must be unique")
        prompt = tuple(int(t) for t in prompt_token_ids)
        resumed = [int(t) for t in resume_token_ids]
        self._check_new(prompt, resumed, sampling, first_start)
        if guide is None:
            guide = self.new_guide(sampling, resumed, tokens_field="resume_token_ids")
        text = resumed_text(self.tokenizer, prompt, sampling, resumed, resume_text)
        request = Request(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            seed=sampling.seed if sampling.seed is not None else secrets.randbits(64),
            arrival_order=next(self._arrivals), text=text, priority=priority,
            num_resumed_tokens=len(resumed), output_token_ids=resumed, guide=guide, first_start=first_start,
            origin=RequestOrigin.RESUMED if resumed else RequestOrigin.DISPATCHED,
            migration_id=replaced_migration_id if resumed else "",
        )  # fmt: skip
        self._requests[request_id] = request
        self.scheduler.add(request)
        self.num_requests_admitted += 1

    def _check_new(self, prompt: tuple[int, ...], resumed: list[int], sampling: SamplingParams,
                   first_start: int | None) -> None:
        sampling.validate(self.config.max_model_len, len(prompt))
        check_tokens(prompt, resumed, sampling, self._limits)
        check_first_start(first_start, len(prompt) + len(resumed), field="resume_first_start")
        if not resumed:
            check_queue_room(len(self.scheduler.waiting), self.config.max_num_waiting)

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; False if the engine does not have it."""
        return self.abort_with_output(request_id) is not None

    def abort_with_output(self, request_id: str) -> StepOutput | None:
        """Abort, returning the request's last output for a client still reading (finish reason ABORT,
        with the text held back for a stop string); None if the engine does not have it."""
        request = self._requests.get(RequestId(request_id))
        if request is None:
            return None
        self.scheduler.remove(request, FinishReason.ABORT)
        self._forget(request)
        return step_output(request, request.num_output_tokens, None, FinishReason.ABORT)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a request unless it ignores eos: the model's and the tokenizer's."""
        return self._steps.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: frozenset[int]) -> None:  # tests take another token as eos
        self._steps.eos_token_ids = token_ids

    @property
    def num_grammar_dead_ends(self) -> int:
        """Requests stopped where their grammar allowed no token (or refused one)."""
        return self._steps.num_grammar_dead_ends

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # Live migration: the source side.

    def pick_for_migration(self, selection: MigrationSelection, exclude: frozenset[str] = frozenset(),
                           dst_max_model_len: int = 0) -> RequestId | None:
        """The request `selection` would move (see `pick_request`) of those a destination serving
        `dst_max_model_len` tokens (0: not known) takes; None if none can move."""
        fits = [r for r in self._requests.values()
                if not dst_max_model_len or max_num_tokens_of(r, self.config.max_model_len) <= dst_max_model_len]
        request = pick_request(fits, selection, exclude, is_batch_full=not self.scheduler.has_free_slot)
        return None if request is None else request.request_id

    def decoding_request_ids(self) -> list[RequestId]:
        """Running requests past their prefill, oldest first (what a PREFILL instance hands to decode instances)."""
        decoding = sorted((r for r in self.scheduler.running if is_prefill_done(r)), key=lambda r: r.arrival_order)
        return [r.request_id for r in decoding]

    def migration_blocks(self, request_id: str) -> MigrationBlocks:
        """Where the request's K/V are now; NotFound once it finished or was aborted."""
        return migration_blocks(self._request(request_id), self.config.block_size, self.config.max_model_len)

    def check_movable(self, request_id: str) -> None:
        """NotFound if gone; FailedPrecondition while its prompt is partly computed (`check_movable`)."""
        check_movable(self._request(request_id))

    def suspend(self, request_id: str) -> MigrationBlocks:
        """Take the request out of the batch (it keeps its blocks) so its last blocks can be copied."""
        request = self._request(request_id)
        if request.status is RequestStatus.SUSPENDED:
            raise FailedPrecondition(f"request {request_id} is already migrating; wait for that migration to end")
        self.check_movable(request_id)
        self.scheduler.suspend(request)
        return self.migration_blocks(request_id)

    def hold(self, request_id: str) -> bool:
        """Park a decoding request (suspended, blocks kept) until its PD hand-off takes it; False if it is not
        decoding now (finished, aborted, preempted). `resume` puts it back if the hand-off cannot happen."""
        request = self._requests.get(RequestId(request_id))
        if request is None or not is_prefill_done(request):
            return False
        self.scheduler.suspend(request)
        return True

    def hold_and_export(self, request_id: str) -> HeldRequest | None:
        """`hold`, and the request's blocks and state for its hand-off; None if it is not decoding."""
        if not self.hold(request_id):
            return None
        return HeldRequest(self.migration_blocks(request_id), self.export_state(request_id), time.perf_counter())

    def suspend_held(self, request_id: str) -> MigrationBlocks:
        """`suspend`, or nothing if the request is held already (the PD hand-off's one stop-and-copy stage)."""
        if self._request(request_id).status is RequestStatus.SUSPENDED:
            return self.migration_blocks(request_id)
        return self.suspend(request_id)

    def export_state(self, request_id: str) -> RequestState:
        """The suspended request's state for its next owner (epoch + 1)."""
        return export_state(self._suspended(request_id), self.config.max_model_len)

    def release(self, request_id: str) -> None:
        """The suspended request now runs elsewhere: free its blocks and forget it (no output)."""
        request = self._suspended(request_id)
        del self._requests[request.request_id]
        self.scheduler.remove(request, FinishReason.ABORT)  # nobody sees this reason: the stream hands off

    def resume(self, request_id: str) -> bool:
        """Back into the batch after a failed migration; False if it is not suspended here (aborted meanwhile)."""
        request = self._requests.get(RequestId(request_id))
        if request is None or request.status is not RequestStatus.SUSPENDED:
            return False
        self.scheduler.resume(request)
        return True

    # Live migration: the destination side.

    def reserve_blocks(self, migration_id: str, num_blocks: int, block_hashes: Sequence[BlockHash] = (),
                       num_not_held: int = 0) -> tuple[BlockId, ...]:
        """Grow the migration's reservation to `num_blocks` block-table entries; ResourceExhausted if short of
        blocks or slots. A new reservation starts with `num_not_held` placeholders (the leading entries behind
        the request's sliding window, which its source no longer holds: no block here), then the cached blocks
        of the longest prefix of `block_hashes` (the request's full blocks): `num_cached_reserved` says how
        many entries those reach, and nothing is copied into them."""
        is_new = migration_id not in self.reservations
        if is_new and not self.scheduler.has_free_slot:
            raise ResourceExhausted(f"no batch slot for migration {migration_id}: all {self.config.max_num_seqs} "
                                    "taken (--max-num-seqs); pick another destination")
        if is_new and num_not_held and self.block_manager.window is None:
            raise InvalidArgument(f"num_leading_blocks_not_held: {num_not_held}, but this instance's model has no "
                                  "sliding window on every layer: it reads every block of a request")
        return self.reservations.reserve(MigrationId(migration_id), num_blocks, block_hashes, num_not_held)

    def num_cached_reserved(self, migration_id: str) -> int:
        """Leading blocks of the migration's reservation that came from the prefix cache."""
        return self.reservations.num_cached(MigrationId(migration_id))

    def keep_cached_reserved(self, migration_id: str, num_kept: int) -> tuple[BlockId, ...]:
        """Keep only the first `num_kept` cached blocks of the reservation (the source found other bits in the
        next one); fresh blocks take the others' places. Every block reserved, in order."""
        return self.reservations.keep_cached(MigrationId(migration_id), num_kept)

    def block_checksums(self, block_ids: Sequence[BlockId]) -> tuple[int, ...]:
        """crc32 of each block over every layer's K and V (services/transfer/checksum.py), in order. Reads
        only the KV tensor: any thread may call it, on blocks that are full and held (nothing writes into them)."""
        return block_checksums(kv_rows(self.kv_cache.tensor), tuple(block_ids)) if block_ids else ()

    def free_reservation(self, migration_id: str) -> bool:
        return self.reservations.free(MigrationId(migration_id))

    def restore_text(self, state: RequestState) -> TextOutput:
        """The text state the source had. Reads only the tokenizer: may run off the engine thread."""
        return migrated_text(self.tokenizer, state)

    def import_request(self, migration_id: str, state: RequestState, text: TextOutput | None = None,
                       guide: Guide | None = None, src_instance_id: str = "") -> None:
        """Adopt a migrated request whose first `num_computed_tokens` tokens' K/V are in the reserved blocks
        (`text` and `guide`: built off the engine thread with `restore_text` and `new_guide`, or here), sent by
        `src_instance_id` (ListRequests names it)."""
        self._check_import(state)
        if guide is None:
            guide = self.new_guide(state.sampling, state.output_token_ids)
        num_blocks = num_blocks_for(state.num_computed_tokens, self.config.block_size)
        self._check_reserved(migration_id, num_blocks, state.num_computed_tokens)
        text = text if text is not None else self.restore_text(state)
        num_not_held = self.reservations.num_not_held(MigrationId(migration_id))
        blocks = self.reservations.take(MigrationId(migration_id))
        self.block_manager.free_blocks(blocks[num_blocks:])  # headroom the source no longer needs (_check_reserved:
        # num_not_held <= num_blocks)
        request = imported_request(state, text=text, guide=guide, block_table=blocks[:num_blocks],
                                   arrival_order=next(self._arrivals), src_instance_id=src_instance_id,
                                   migration_id=migration_id)
        self._requests[request.request_id] = request
        self.block_manager.adopt_out_of_window(request, num_not_held)  # placeholders from the reservation
        self.block_manager.drop_out_of_window(request)  # the source copied none of these (MigrationBlocks)
        self.block_manager.register_computed(request)  # its K/V arrived with it
        self.scheduler.adopt(request)
        self.num_requests_migrated_in += 1

    def _check_reserved(self, migration_id: str, num_blocks: int, num_computed_tokens: int) -> None:
        num_reserved = len(self.reservations.blocks(MigrationId(migration_id)))
        if num_reserved < num_blocks:
            raise InvalidArgument(f"num_computed_tokens: {num_computed_tokens} tokens need {num_blocks} blocks, "
                                  f"migration {migration_id} reserved {num_reserved}")
        num_not_held = self.reservations.num_not_held(MigrationId(migration_id))
        num_out = num_blocks_out_of_window(num_computed_tokens, self.config.block_size, self.block_manager.window)
        if num_not_held > num_out:  # the request was recomputed on its source since the first Prepare
            raise FailedPrecondition(f"num_computed_tokens: at {num_computed_tokens} tokens the request still reads "
                                     f"blocks from {num_out} on, but migration {migration_id} reserved no block for "
                                     f"the first {num_not_held} (num_leading_blocks_not_held); start it again")

    def _check_import(self, state: RequestState) -> None:
        if state.request_id in self._requests:
            raise FailedPrecondition(f"request {state.request_id} is already on this instance")
        check_import(state, self._limits)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)

    def _request(self, request_id: str) -> Request:
        request = self._requests.get(RequestId(request_id))
        if request is None:
            raise NotFound(f"request {request_id} is not on this instance (finished, aborted, moved away or never here)")
        return request

    def _suspended(self, request_id: str) -> Request:
        request = self._request(request_id)
        if request.status is not RequestStatus.SUSPENDED:
            raise FailedPrecondition(f"request {request_id} is {request.status.value}, not suspended; suspend it first")
        return request

    def new_guide(self, sampling: SamplingParams, output_token_ids: Sequence[int],
                  tokens_field: str = "output_token_ids") -> Guide | None:
        """The grammar state past `output_token_ids` (None without a grammar); may run off the engine thread:
        a complex grammar takes a while to build (llguidance lets go of the GIL meanwhile)."""
        return self.grammars.guide(sampling.grammar, output_token_ids, tokens_field=tokens_field) \
            if sampling.grammar else None

    # One step.

    def step(self) -> list[StepOutput]:
        """One batch (engine_step.py); `last_step_was_idle` says afterwards whether it had nothing to do (the
        waiting requests cannot be admitted until blocks or slots are freed: wait for a command then)."""
        return self._steps.step()

    @property
    def last_step_was_idle(self) -> bool:
        return self._steps.last_step_was_idle

    # Reports.

    def load(self) -> LoadSnapshot:
        return load_snapshot(self.scheduler, self.config, len(self.reservations), self.num_requests_admitted,
                             self.num_requests_migrated_in)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens admitted so far and how many came from the prefix cache (zeros when it is off)."""
        cache = self.block_manager.prefix_cache
        return cache.stats() if cache is not None else NO_PREFIX_CACHE_STATS

    def list_requests(self) -> list[RequestSnapshot]:
        """The requests on this engine. Also safe from another thread while a step runs (admin
        reads during a long prefill step): the request table is copied in one step under the GIL,
        and a request's fields may then be read mid-step."""
        return [request_snapshot(r) for r in tuple(self._requests.values())]

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Run `prompts` (token ids) to completion, in one batch; their output token ids, in order. `sampling`:
        one for every prompt, or one each. For tests and benchmarks."""
        samplings = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(samplings) != len(prompts):
            raise InvalidArgument(f"{len(samplings)} sampling params for {len(prompts)} prompts")
        request_ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt, params in zip(request_ids, prompts, samplings):
            self.add_request(request_id, prompt, params)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        num_unfinished = len(request_ids)
        while num_unfinished:
            for output in self.step():
                if output.request_id in tokens:
                    tokens[output.request_id] += output.new_token_ids
                    num_unfinished -= output.finish_reason is not None
        return [tokens[request_id] for request_id in request_ids]

