"""Scheduler on CPU without a model: budgets, chunked prefill, preemption, priority."""

import itertools

import pytest

from services.instance.engine.block_manager import BlockManager
from services.instance.engine.request import FinishReason, Request, RequestId, RequestStatus, SamplingParams
from services.instance.engine.scheduler import Scheduler, SchedulerOutput, _StepPlan
from services.instance.engine.text_output import TextOutput

pytestmark = pytest.mark.timeout(20)

_arrivals = itertools.count()


class _NoText:
    def feed(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_request(num_prompt_tokens: int, name: str, priority: int = 0) -> Request:
    return Request(RequestId(name), tuple(range(1, num_prompt_tokens + 1)), SamplingParams(), seed=0,
                   arrival_order=next(_arrivals), text=TextOutput(_NoText(), ()), priority=priority)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, prefill_chunk_tokens: int = 0) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens,
                     prefill_chunk_tokens=prefill_chunk_tokens)


def run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step with a fake model: every sampled request gets `token`."""
    output = scheduler.schedule()
    for s in output.scheduled:
        if s.is_sampled:
            s.request.output_token_ids.append(token)
    check_invariants(scheduler)
    return output


def check_invariants(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    held = [b for r in scheduler.running for b in r.block_table]
    assert len(held) == len(set(held)) == manager.num_used_blocks
    assert all(not r.block_table and r.num_computed_tokens == 0 for r in scheduler.waiting)
    assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)
    assert all(len(r.block_table) * manager.block_size >= r.num_computed_tokens for r in scheduler.running)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def new_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in output.scheduled}


def test_forward_batch_packs_tokens_positions_and_slots():
    scheduler = make_scheduler(block_size=4)
    a, b = make_request(6, "a"), make_request(3, "b")
    scheduler.add(a)
    scheduler.add(b)
    batch = run_step(scheduler).batch
    assert batch.query_lens == [6, 3]
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    expected_slots = [a.block_table[p // 4] * 4 + p % 4 for p in range(6)]
    expected_slots += [b.block_table[0] * 4 + p for p in range(3)]
    assert batch.slot_mapping.tolist() == expected_slots
    assert batch.context_lens.tolist() == [6, 3]
    assert batch.block_tables.tolist() == [a.block_table, b.block_table + [0]]
    decode = run_step(scheduler).batch
    assert decode.is_decode_only
    assert decode.input_ids.tolist() == [7, 7] and decode.positions.tolist() == [6, 3]
    assert decode.context_lens.tolist() == [7, 4]


def test_token_budget_and_batch_slots_are_respected():
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=5, max_num_batched_tokens=20)
    for i in range(12):
        scheduler.add(make_request(3 + 5 * i, f"r{i}"))
    for _ in range(40):
        output = run_step(scheduler)
        assert output.num_batched_tokens <= 20
        assert len(output.scheduled) <= 5
        for r in list(scheduler.running):
            if r.num_output_tokens >= 4:
                scheduler.remove(r, FinishReason.LENGTH)
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 256


def test_long_prompt_is_prefilled_in_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=24)  # 8 slots: chunks of half (24 - 8) tokens
    assert scheduler.prefill_chunk_tokens == 8
    request = make_request(50, "long")
    scheduler.add(request)
    chunks = []
    for _ in range(7):
        (s,) = run_step(scheduler).scheduled
        chunks.append((s.num_new_tokens, s.is_sampled))
    assert chunks == [(8, False)] * 6 + [(2, True)]
    assert request.output_token_ids == [7]
    (s,) = run_step(scheduler).scheduled
    assert (s.num_new_tokens, s.is_sampled) == (1, True)


def test_decodes_run_before_new_prefills_take_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=12, max_num_seqs=2, prefill_chunk_tokens=8)
    a = make_request(4, "a")
    scheduler.add(a)
    run_step(scheduler)
    scheduler.add(make_request(30, "b"))
    scheduler.add(make_request(30, "c"))
    assert new_tokens(run_step(scheduler)) == {"a": 1, "b": 8}  # c's chunk of 8 does not fit in the 3 left
    assert new_tokens(run_step(scheduler)) == {"a": 1, "b": 8}


def test_a_prompt_is_cut_at_the_same_places_alone_and_beside_decodes():
    """Chunks end at multiples of prefill_chunk_tokens whatever the step's budget has left (batch invariance)."""
    def chunks(num_decoding: int) -> list[int]:
        scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4, prefill_chunk_tokens=12)
        for i in range(num_decoding):
            scheduler.add(make_request(3, f"d{i}"))
        run_step(scheduler)
        prompt = make_request(40, "p")
        scheduler.add(prompt)
        sizes = []
        while prompt.num_computed_tokens < 40:
            sizes += [n for name, n in new_tokens(run_step(scheduler)).items() if name == "p"]
        return sizes
    assert chunks(0) == chunks(1) == chunks(3) == [12, 12, 12, 4]


def test_by_default_a_short_prompt_starts_beside_a_long_one_mid_prefill():
    """Chunks are half what a step leaves beside full decodes, so a prompt that arrives while a long one
    prefills takes its first chunk in the next step instead of waiting for the long one to finish."""
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=40, max_num_seqs=8)  # (40 - 8) / 2
    assert scheduler.prefill_chunk_tokens == 16
    for i in range(8 - 2):
        scheduler.add(make_request(1, f"d{i}"))
    run_step(scheduler)
    scheduler.add(make_request(100, "long"))
    assert new_tokens(run_step(scheduler))["long"] == 16
    scheduler.add(make_request(30, "short"))
    step = new_tokens(run_step(scheduler))
    assert step["long"] == 16 and step["short"] == 16  # beside six decodes


def test_a_chunk_size_no_step_could_always_take_is_refused():
    with pytest.raises(ValueError, match="--prefill-chunk-tokens must be between 1 and .* \\(56\\), got 57"):
        make_scheduler(max_num_batched_tokens=64, max_num_seqs=8, prefill_chunk_tokens=57)
    assert make_scheduler(max_num_batched_tokens=64, max_num_seqs=8, prefill_chunk_tokens=56).prefill_chunk_tokens == 56


def test_higher_priority_is_admitted_first():
    scheduler = make_scheduler(max_num_seqs=1)
    low, high = make_request(4, "low", priority=0), make_request(4, "high", priority=5)
    scheduler.add(low)
    scheduler.add(high)
    assert list(new_tokens(run_step(scheduler))) == ["high"]
    scheduler.remove(high, FinishReason.STOP)
    assert list(new_tokens(run_step(scheduler))) == ["low"]


def test_same_priority_is_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in ("a", "b", "c"):
        scheduler.add(make_request(4, name))
    assert list(new_tokens(run_step(scheduler))) == ["a", "b"]


def test_preemption_frees_the_latest_and_it_resumes_with_its_tokens():
    # 4 blocks of 4 tokens; two 8-token prompts take 2 blocks each; decoding needs more.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first, second = make_request(8, "first"), make_request(8, "second")
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler, token=11)  # prefill both; each samples a token at position 8
    output = run_step(scheduler, token=12)  # `first` needs a 3rd block: `second` (later) is preempted
    assert output.preempted == [second]
    assert second.status is RequestStatus.WAITING and second.block_table == []
    assert second.output_token_ids == [11] and second.num_preemptions == 1
    assert new_tokens(output) == {"first": 1}
    scheduler.remove(first, FinishReason.STOP)
    output = run_step(scheduler, token=13)
    assert new_tokens(output) == {"second": 8}  # recomputes the prompt, then its generated token on its own
    assert output.batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and second.output_token_ids == [11]
    output = run_step(scheduler, token=13)
    assert new_tokens(output) == {"second": 1} and output.batch.input_ids.tolist() == [11]
    assert second.output_token_ids == [11, 13]


def test_output_tokens_computed_again_attend_one_by_one_as_their_decode_steps_did():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    request = make_request(6, "r")
    request.output_token_ids += [21, 22, 23, 24, 25]  # came back with five (a resume, a preemption)
    scheduler.add(request)
    assert new_tokens(run_step(scheduler)) == {"r": 6}  # the prompt, cut as it was the first time
    output = run_step(scheduler)
    assert new_tokens(output) == {"r": 5} and output.batch.decode_tails == [5]
    view = output.batch.attention_view()
    assert view.query_lens == [1] * 5 and view.context_lens.tolist() == [7, 8, 9, 10, 11]
    assert view.block_tables.tolist() == [request.block_table] * 5


def test_lower_priority_is_preempted_even_if_it_arrived_first():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    low, high = make_request(8, "low", priority=0), make_request(8, "high", priority=1)
    scheduler.add(low)
    scheduler.add(high)
    run_step(scheduler)
    output = run_step(scheduler)
    assert output.preempted == [low] and new_tokens(output) == {"high": 1}


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first, second = make_request(8, "first"), make_request(8, "second")
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    output = run_step(scheduler)
    assert output.preempted == [second] and second in scheduler.waiting
    assert new_tokens(output) == {"first": 1}


def test_request_longer_than_the_cache_finishes_with_length():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    request = make_request(8, "r")
    scheduler.add(request)
    run_step(scheduler)  # 8 tokens fill both blocks, a 9th is sampled
    output = run_step(scheduler)
    assert output.finished == [request] and output.scheduled == []
    assert request.finish_reason is FinishReason.LENGTH
    assert scheduler.block_manager.num_free_blocks == 2 and not scheduler.has_unfinished()


def test_a_preempted_request_grown_past_the_cache_finishes_with_length_instead_of_blocking_the_queue():
    """Preempted with more tokens than the whole cache holds, it can never be admitted again: before,
    it stayed at the head of the waiting queue and nothing behind it ever ran."""
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    request, later = make_request(8, "r"), make_request(2, "later")
    scheduler.add(request)
    run_step(scheduler)
    request.output_token_ids += [7] * 9  # 17 tokens: more than the 16 the cache holds
    scheduler.running.remove(request)
    scheduler.block_manager.free(request)
    request.num_computed_tokens = 0
    scheduler.add(request)  # as a preemption leaves it
    scheduler.add(later)
    output = run_step(scheduler)
    assert output.finished == [request] and request.finish_reason is FinishReason.LENGTH
    assert new_tokens(output) == {"later": 2}


def test_a_better_prefill_preempts_a_worse_decode_already_scheduled_in_the_step():
    """Decodes are scheduled first, but one of lower priority is still the victim: before, the
    high-priority prefill found no unscheduled victim, so it shrank its chunk (or preempted itself)
    while the worse decode kept its blocks."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=10, max_num_seqs=2,
                               prefill_chunk_tokens=8)
    low = make_request(5, "low")
    scheduler.add(low)
    run_step(scheduler)  # low: 5 tokens + 1 sampled, 2 blocks
    high = make_request(20, "high", priority=10)
    scheduler.add(high)
    assert new_tokens(run_step(scheduler)) == {"low": 1, "high": 8}  # 4 blocks used
    assert new_tokens(run_step(scheduler)) == {"low": 1, "high": 8}  # 6 blocks used: all
    output = run_step(scheduler)  # high needs a 7th block: low goes, its decode taken out of the step
    assert output.preempted == [low] and new_tokens(output) == {"high": 4}
    assert high.status is RequestStatus.RUNNING and low.status is RequestStatus.WAITING
    assert low.num_computed_tokens == 0 and low.block_table == []


def test_slots_reserved_for_migrations_in_are_not_admitted_into():
    reserved = [1]
    scheduler = Scheduler(BlockManager(64, 4), 2, 64, num_reserved_slots=lambda: reserved[0])
    first, second = make_request(4, "first"), make_request(4, "second")
    scheduler.add(first)
    scheduler.add(second)
    assert new_tokens(run_step(scheduler)) == {"first": 4}  # the other slot is held for a migration
    reserved[0] = 0  # it committed elsewhere, or was given up
    assert new_tokens(run_step(scheduler)) == {"first": 1, "second": 4}


def test_prefill_chunk_shrinks_to_free_blocks_instead_of_preempting_a_better_request():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=10, max_num_seqs=2,
                               prefill_chunk_tokens=8)
    high = make_request(24, "high", priority=1)
    scheduler.add(high)
    for _ in range(3):
        run_step(scheduler)  # high: 24 tokens in 6 blocks, samples a 25th
    low = make_request(40, "low")
    scheduler.add(low)
    assert new_tokens(run_step(scheduler)) == {"high": 1, "low": 8}  # 9 blocks used
    assert new_tokens(run_step(scheduler)) == {"high": 1, "low": 8}  # 11 blocks used
    assert new_tokens(run_step(scheduler)) == {"high": 1, "low": 4}  # the chunk shrinks to the last block
    output = run_step(scheduler)  # no block left for low, and it may not preempt high
    assert output.preempted == [low] and new_tokens(output) == {"high": 1}


def test_remove_frees_blocks_from_either_queue():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_request(5, "a"), make_request(5, "b")
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    scheduler.remove(b, FinishReason.ABORT)
    scheduler.remove(a, FinishReason.ABORT)
    assert a.status is b.status is RequestStatus.FINISHED
    assert scheduler.block_manager.num_free_blocks == 8 and not scheduler.has_unfinished()


def test_many_requests_under_pressure_all_finish_and_free_everything():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=10)
    requests = [make_request(3 + (7 * i) % 13, f"r{i}", priority=i % 3) for i in range(15)]
    for r in requests:
        scheduler.add(r)
    for _ in range(500):
        run_step(scheduler)
        for r in list(scheduler.running):
            if r.num_output_tokens >= 6:
                scheduler.remove(r, FinishReason.LENGTH)
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()
    assert all(r.num_output_tokens == 6 for r in requests)
    assert scheduler.block_manager.num_free_blocks == 12


def test_prompt_logprobs_prefills_share_a_bounded_number_of_logits_rows():
    """Each of their tokens is a vocabulary-wide logits row: at most max_prompt_logit_rows a step, in order;
    other requests prefill as usual, and the batch asks the model for their rows alone."""
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_prompt_logit_rows=10)
    scored = [make_request(12, name) for name in ("s1", "s2")]
    for request in scored:
        request.sampling = SamplingParams(prompt_logprobs=1)
    plain = make_request(20, "plain")
    for request in (*scored, plain):
        scheduler.add(request)
    first = run_step(scheduler)
    assert new_tokens(first) == {"s1": 10}  # the head of the queue waits for rows; strict priority holds the rest
    assert first.batch.logit_lens == [10]
    second = run_step(scheduler)
    assert new_tokens(second) == {"s1": 2, "s2": 8, "plain": 20}
    assert second.batch.logit_lens == [2, 8, 1]
    assert sum(second.batch.num_logits) == len(second.batch.logit_indices()) == 11
    assert new_tokens(run_step(scheduler)) == {"s1": 1, "s2": 4, "plain": 1}  # s1 decodes: no more rows


def test_where_decodes_could_take_the_whole_budget_chunks_are_cut_where_it_ends():
    """A budget less than a block above max_num_seqs leaves no fixed chunk that always fits (found by a
    review: prompts waited for whole decodes to finish); chunks then take what the step has left."""
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=16)
    assert scheduler.prefill_chunk_tokens is None
    for i in range(12):
        scheduler.add(make_request(1, f"d{i}"))
    run_step(scheduler)
    prompt = make_request(20, "p")
    scheduler.add(prompt)
    assert new_tokens(run_step(scheduler))["p"] == 4  # beside the 12 decodes
    assert prompt.status is RequestStatus.RUNNING


def _pressure_run(scheduler: Scheduler) -> list[tuple]:
    """Steps under block pressure (preemptions, chunked prefills, a prompt-logprobs request), as comparable tuples."""
    requests = [make_request(3 + (7 * i) % 13, f"r{i}", priority=i % 3) for i in range(15)]
    requests[4].sampling = SamplingParams(prompt_logprobs=1)
    for r in requests:
        scheduler.add(r)
    steps = []
    while scheduler.has_unfinished():
        output = run_step(scheduler)
        batch = output.batch
        steps.append(([(s.request.request_id, s.num_new_tokens, s.is_sampled) for s in output.scheduled],
                      [r.request_id for r in output.preempted],
                      None if batch is None else (batch.input_ids.tolist(), batch.slot_mapping.tolist(),
                                                  batch.block_tables.tolist(), batch.logit_lens)))
        for r in list(scheduler.running):
            if r.num_output_tokens >= 6:
                scheduler.remove(r, FinishReason.LENGTH)
    return steps


def test_a_plain_decode_is_scheduled_as_the_general_path_schedules_it(monkeypatch):
    """A running request's one token that fits its blocks skips the checks, chunking and allocation of the
    general path (the engine's per-step cost with many decodes): the steps must come out the same."""
    shortcut = _pressure_run(make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=10))
    monkeypatch.setattr(Scheduler, "_is_plain_decode", lambda self, request: False)
    general = _pressure_run(make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=10))
    assert any(preempted for _, preempted, _ in general)  # the run does go through preemptions
    assert shortcut == general


@pytest.mark.parametrize("first_start, start", [(0, 24), (16, 24), (12, 12)])
def test_a_preempted_request_restarts_at_its_last_cached_chunk_boundary_unless_it_first_started_off_one(
        first_start, start):
    """A request preempted with 7 of its 30-token prompt's blocks still cached (8-token chunks) restarts at the last
    chunk boundary among them, 24, where its prompt was cut the first time, not at 0 (its whole prompt again); one
    first computed from 12, off a chunk boundary (after a sibling's cached blocks), restarts there: the blocks up
    to 24 may be the sibling's, whose rows past 12 have other bits."""
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=True), 8, 64, prefill_chunk_tokens=8)
    request = make_request(30, "r")
    scheduler.add(request)
    while not request.output_token_ids:
        run_step(scheduler)
        scheduler.block_manager.register_computed(request)  # the engine does, after each step
    request.first_start = first_start
    scheduler._preempt(request, _StepPlan(budget=0, logit_budget=0))
    assert len(scheduler.block_manager.cached_prefix(request)) == 7
    assert len(scheduler._cached_start(request)) * 4 == start
