"""Sampler: greedy, seeded sampling that ignores the batch and resumes at any token index, logprobs."""

import pytest
import torch

from services.instance.engine.logprobs import token_logprobs
from services.instance.engine.request import SamplingParams
from services.instance.engine.sampler import Sampler, SamplingRow, adjusted_logits

pytestmark = pytest.mark.timeout(30)

VOCAB = 50


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(1)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [t.token_id for t in Sampler()(logits, rows)]


HOT = SamplingParams(temperature=1.0)


def test_greedy_is_argmax():
    logits = random_logits(4)
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=i, token_index=i) for i in range(4)]
    assert tokens(logits, rows) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_a_temperature_below_vllms_epsilon_is_greedy_not_nan(temperature):
    # logits / 1e-38 overflow to inf: the probabilities were NaN and every token id 0
    logits = random_logits(4, seed=3)
    rows = [SamplingRow(SamplingParams(temperature=temperature), seed=i, token_index=i) for i in range(4)]
    assert tokens(logits, rows) == logits.argmax(dim=-1).tolist()


def test_seeded_row_is_the_same_alone_and_in_a_busy_batch():
    logits = random_logits(6, seed=1)
    row = SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), seed=1234, token_index=3)
    alone = tokens(logits[2:3], [row])
    others = [
        SamplingRow(SamplingParams(temperature=0.0), seed=1, token_index=0),
        SamplingRow(SamplingParams(temperature=1.5, top_k=3), seed=99, token_index=7),
        row,
        SamplingRow(SamplingParams(temperature=0.5, top_p=0.5), seed=1234, token_index=4),
        SamplingRow(HOT, seed=5, token_index=3),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=5), seed=6, token_index=0),
    ]
    assert tokens(logits, others)[2] == alone[0]


def test_seeded_sequence_resumes_at_any_token_index():
    logits = random_logits(1, seed=2).expand(12, VOCAB).contiguous()
    full = tokens(logits, [SamplingRow(HOT, seed=42, token_index=i) for i in range(12)])
    resumed = tokens(logits[:5], [SamplingRow(HOT, seed=42, token_index=i) for i in range(7, 12)])
    assert resumed == full[7:]
    one_by_one = [tokens(logits[:1], [SamplingRow(HOT, seed=42, token_index=i)])[0] for i in range(12)]
    assert one_by_one == full


def test_different_seeds_and_indices_differ():
    logits = torch.zeros(40, VOCAB)  # uniform: every token equally likely
    by_seed = tokens(logits, [SamplingRow(HOT, seed=s, token_index=0) for s in range(40)])
    by_index = tokens(logits, [SamplingRow(HOT, seed=0, token_index=i) for i in range(40)])
    assert len(set(by_seed)) > 10 and len(set(by_index)) > 10


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    sampled = torch.tensor(tokens(logits, [SamplingRow(HOT, seed=7, token_index=i) for i in range(4000)]))
    frequencies = torch.bincount(sampled, minlength=4).float() / 4000
    assert torch.allclose(frequencies, probs, atol=0.03), frequencies


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(2000, 4).contiguous()
    cold = SamplingParams(temperature=0.2)
    sampled = tokens(logits, [SamplingRow(cold, seed=3, token_index=i) for i in range(2000)])
    assert sampled.count(0) / 2000 > 0.98


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0, -2.0]]).expand(500, 5).contiguous()
    top2 = SamplingParams(temperature=2.0, top_k=2)
    assert set(tokens(logits, [SamplingRow(top2, seed=1, token_index=i) for i in range(500)])) == {0, 1}
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    assert set(tokens(logits, [SamplingRow(nucleus, seed=1, token_index=i) for i in range(500)])) == {0}
    top1 = SamplingParams(temperature=5.0, top_k=1)
    assert set(tokens(logits[:100], [SamplingRow(top1, seed=1, token_index=i) for i in range(100)])) == {0}


def test_logprobs_are_raw_log_softmax_and_top_n():
    logits = random_logits(3, seed=4)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=3), seed=0, token_index=0),
        SamplingRow(SamplingParams(temperature=0.7, logprobs=1), seed=9, token_index=2),
        SamplingRow(SamplingParams(temperature=0.0), seed=0, token_index=0),
    ]
    first, second, third = Sampler()(logits, rows)
    expected = logits.log_softmax(dim=-1)
    assert third.logprob is None
    assert first.logprob.token_id == first.token_id
    assert first.logprob.logprob == pytest.approx(expected[0, first.token_id].item(), abs=1e-5)
    top = expected[0].topk(3)
    assert list(first.logprob.top_token_ids) == top.indices.tolist()
    assert list(first.logprob.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-5)
    assert first.logprob.top_token_ids[0] == first.token_id  # greedy picks the most likely
    assert second.logprob.logprob == pytest.approx(expected[1, second.token_id].item(), abs=1e-5)
    assert len(second.logprob.top_token_ids) == 1


def test_rows_must_match_logits():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(random_logits(2), [SamplingRow(HOT, seed=0, token_index=0)])


def penalized(presence: float = 0.0, frequency: float = 0.0, bias: tuple = ()) -> SamplingParams:
    return SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias)


def test_penalties_follow_openais_formula_on_the_output_only():
    logits = random_logits(1, seed=4)
    output = [7, 7, 7, 2, 9]
    params = penalized(presence=0.7, frequency=0.3)
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    expected = (logits[0] - 0.3 * counts - 0.7 * (counts > 0).float()).argmax().item()
    assert tokens(logits, [SamplingRow(params, seed=0, token_index=5, output_token_ids=output)]) == [expected]


def test_a_presence_penalty_moves_greedy_off_a_repeated_token():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 8] = 5.0, 4.9
    assert tokens(logits, [SamplingRow(penalized(), 0, 1, output_token_ids=[4])]) == [4]
    assert tokens(logits, [SamplingRow(penalized(presence=0.5), 0, 1, output_token_ids=[4])]) == [8]
    assert tokens(logits, [SamplingRow(penalized(frequency=0.06), 0, 2, output_token_ids=[4, 4])]) == [8]
    assert tokens(logits, [SamplingRow(penalized(frequency=0.06), 0, 1, output_token_ids=[4])]) == [4]


def test_logit_bias_bans_and_forces_tokens_and_logprobs_stay_raw():
    logits = random_logits(2, seed=5)
    best = int(logits[0].argmax())
    banned = SamplingRow(SamplingParams(temperature=0.0, logprobs=1, logit_bias=((best, -100.0),)), 0, 0)
    forced = SamplingRow(SamplingParams(temperature=1.0, logit_bias=((11, 100.0),)), seed=3, token_index=0)
    first, second = Sampler()(logits, [banned, forced])
    assert first.token_id != best and second.token_id == 11
    assert first.logprob.top_token_ids == (best,)  # logprobs of the raw logits
    assert first.logprob.logprob == pytest.approx(logits[0].log_softmax(-1)[first.token_id].item())


def test_a_token_biased_twice_takes_both_biases():
    """Over gRPC a token may come twice in logit_bias (the HTTP API's JSON object cannot): both apply."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 8] = 5.0, 4.0
    assert tokens(logits, [SamplingRow(penalized(bias=((8, 0.6), (8, 0.6))), 0, 0)]) == [8]
    assert tokens(logits, [SamplingRow(penalized(bias=((8, 0.6),)), 0, 0)]) == [4]


def test_rows_without_adjustments_are_untouched_in_a_mixed_batch():
    logits = random_logits(2, seed=6)
    plain = SamplingRow(SamplingParams(temperature=0.0), 0, 0, output_token_ids=[int(logits[0].argmax())])
    other = SamplingRow(penalized(presence=2.0), 0, 0, output_token_ids=[int(logits[1].argmax())])
    assert tokens(logits, [plain, other])[0] == int(logits[0].argmax())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 3] = 3.0, 2.9, -1.0  # 1 (prompt) and 3 (output) were seen
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=0)
    row = SamplingRow(params, 0, 1, output_token_ids=[3], prompt_token_ids=[1, 1])
    assert tokens(logits, [row]) == [2]  # 3.0 / 1.5 = 2.0 < 2.9
    adjusted = adjusted_logits(logits, [row])[0]
    assert adjusted[1:4].tolist() == pytest.approx([2.0, 2.9, -1.5])


def test_min_p_never_samples_tokens_far_below_the_top_one():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1] + [1e-9] * (VOCAB - 3)]))
    chosen = {tokens(logits, [SamplingRow(SamplingParams(temperature=1.0, min_p=0.4), seed=s, token_index=0)])[0]
              for s in range(300)}
    assert chosen == {0, 1}  # 0.1 < 0.4 * 0.6


def test_a_grammar_mask_leaves_only_the_allowed_tokens_greedy_and_sampled():
    logits = random_logits(2, seed=4)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[3, 17, 40]] = True
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=1, token_index=0, allowed=allowed),
            SamplingRow(SamplingParams(temperature=1.5), seed=2, token_index=0, allowed=allowed)]
    best_allowed = max((3, 17, 40), key=lambda t: logits[0, t].item())
    assert tokens(logits, rows)[0] == best_allowed
    sampled = {tokens(logits[1:], [SamplingRow(rows[1].params, seed=s, token_index=0, allowed=allowed)])[0]
               for s in range(40)}
    assert sampled <= {3, 17, 40} and len(sampled) > 1
    # Logprobs stay those of the raw logits (like vLLM's default).
    logprob = Sampler()(logits[:1], [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 1, 0,
                                                 allowed=allowed)])[0].logprob
    assert logprob.logprob == pytest.approx(logits[0].log_softmax(-1)[best_allowed].item(), abs=1e-5)


def test_the_grammar_wins_over_banned_tokens_where_it_allows_nothing_else():
    logits = random_logits(1, seed=5)
    only_eos = torch.zeros(VOCAB, dtype=torch.bool)
    only_eos[7] = True
    row = SamplingRow(SamplingParams(temperature=0.0), seed=1, token_index=0, banned_token_ids=(7,), allowed=only_eos)
    assert tokens(logits, [row]) == [7]
    some = only_eos.clone()
    some[[9, 11]] = True
    row = SamplingRow(SamplingParams(temperature=0.0), seed=1, token_index=0, banned_token_ids=(7, 7), allowed=some)
    assert adjusted_logits(logits, [row])[0, 7] == float("-inf")
    assert tokens(logits, [row])[0] in (9, 11)


def test_top_logprobs_with_equal_values_come_lowest_token_id_first():
    """`topk` orders ties as it pleases (here: 3, 4, 1, 0, 2 of five equal ones), so after a migration or a
    resume, in another batch, the same token's top logprobs could come in another order."""
    logits = torch.zeros(3, 49152)
    logits[1, 40000:] = 1.0  # the top 5 are all tied, far from id 0
    logits[2, ::2] = 1.0  # ties among the top, and tokens tied with the 5th left out
    logits[2, 7] = 2.0
    entries = token_logprobs(logits, torch.tensor([0, 0, 0]), [5, 5, 3])
    assert [entry.top_token_ids for entry in entries] == [(0, 1, 2, 3, 4), (40000, 40001, 40002, 40003, 40004),
                                                          (7, 0, 2)]
    assert entries[2].top_logprobs[1] == entries[2].top_logprobs[2] < entries[2].top_logprobs[0]
