"""The pure plan / verify / accept steps on small hand-built tensors, with hand-computed expectations."""

import pytest
import torch

from refusion.decode.infill import (
    FastAccept,
    cut_after_first_eos,
    fast_accept,
    force_progress,
    shared_advance,
    shifted_token_probs,
    verify_selected,
)
from refusion.decode.plan import greedy, next_token, plan_slots, select_slots, token_confidence
from refusion.decode.sampling import PositionNoise, decided_tokens, position_seed
from refusion.decode.speculate import Drafts, accept_drafts


def log_probs(*rows) -> torch.Tensor:
    """Logits whose softmax is exactly the given rows of probabilities (0 -> -inf)."""
    return torch.tensor(rows, dtype=torch.float32).log()


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------- plan
def test_select_slots_takes_every_score_above_the_threshold_in_position_order():
    scores = torch.tensor([0.2, 0.9, 0.5, 0.95])
    assert select_slots(scores, 0.5).tolist() == [1, 3]  # strictly above: 0.5 is not selected


def test_select_slots_falls_back_to_the_single_best():
    assert select_slots(torch.tensor([0.2, 0.4, 0.3]), 0.5).tolist() == [1]


def test_plan_drafts_the_argmax_and_scores_its_probability():
    logits = log_probs([0.1, 0.7, 0.2], [0.5, 0.2, 0.3])
    plan = plan_slots(logits, slot_size=1, slot_threshold=0.0)  # temperature 0 needs no generator
    assert plan.drafts.tolist() == [[1], [0]]
    assert plan.scores.tolist() == pytest.approx([0.7, 0.5])


def test_sampled_drafts_keep_the_unnoised_confidence():
    probs = torch.tensor([[0.4, 0.35, 0.25]] * 64)
    plan = plan_slots(probs.log(), slot_size=1, slot_threshold=0.0, temperature=1.0, generator=seeded())
    tokens = plan.drafts.squeeze(1)
    assert len(set(tokens.tolist())) > 1  # sampled, not argmax
    assert plan.scores.tolist() == pytest.approx(probs.gather(1, tokens[:, None]).squeeze(1).tolist())


def test_plan_slots_groups_drafts_by_slot_and_scores_by_first_token():
    logits = log_probs([0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8])  # 2 slots of 2 tokens
    plan = plan_slots(logits, slot_size=2, slot_threshold=0.8)
    assert plan.drafts.tolist() == [[0, 0], [1, 1]]
    assert plan.scores.tolist() == pytest.approx([0.9, 0.7])
    assert plan.selected.tolist() == [0]


def test_plan_slots_samples_every_position_and_scores_first_tokens():
    logits = torch.randn(6, 5, generator=seeded(1))  # 2 slots of 3
    plan = plan_slots(logits, slot_size=3, slot_threshold=0.0, temperature=1.0, generator=seeded())
    tokens = next_token(logits, 1.0, seeded()).squeeze(-1)  # the same noise: the same drafts
    assert plan.drafts.flatten().tolist() == tokens.tolist()
    assert torch.equal(plan.scores, token_confidence(logits, tokens).view(2, 3)[:, 0])


def test_next_token_greedy_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert next_token(logits, 0.0, None).tolist() == [[1], [0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_is_argmax_and_takes_the_first_of_tied_maxima(dtype):
    logits = torch.randn(5, 3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 0, [7, 300, 999]] = 50.0  # ties: the first index wins, as with argmax
    logits[1, 2, [0, 1]] = 50.0
    logits[2, 1, [5, 9]] = float("nan")  # the first NaN, as torch's max reduction takes it
    with torch.inference_mode():  # as the decoder calls it
        chosen = greedy(logits)
    assert chosen.dtype == torch.int64 and torch.equal(chosen, logits.max(-1).indices)
    assert chosen[0, 0] == 7 and chosen[1, 2] == 0 and chosen[2, 1] == 5
    assert torch.equal(greedy(logits[:, 1]), logits[:, 1].max(-1).indices)  # a strided view
    assert greedy(logits[0, 0]).shape == () and greedy(logits[:0]).shape == (0, 3)


def test_next_token_sampling_is_reproducible_and_follows_the_softmax():
    logits = log_probs([0.75, 0.25]).expand(4000, 2)
    first, again = next_token(logits, 1.0, seeded(7)), next_token(logits, 1.0, seeded(7))
    assert torch.equal(first, again)
    assert not torch.equal(first, next_token(logits, 1.0, seeded(8)))
    assert (first == 0).float().mean().item() == pytest.approx(0.75, abs=0.03)
    # temperature sharpens: softmax(log p / 0.25) puts 0.75^4 / (0.75^4 + 0.25^4) = 81/82 on token 0
    cold = next_token(logits, 0.25, seeded(7))
    assert (cold == 0).float().mean().item() == pytest.approx(81 / 82, abs=0.01)


# ------------------------------------------------------------------------------------------- verify
@pytest.mark.parametrize("width", [1, 2, 5])
def test_shifted_token_probs_at_every_width_is_the_softmax_one_position_back(width):
    logits, tokens = torch.randn(3, width, 7, generator=seeded()), torch.randint(7, (3, width), generator=seeded())
    probs = logits.softmax(-1)
    expected = torch.cat([probs[:, :1].gather(-1, tokens[:, :1, None]),
                          probs[:, :-1].gather(-1, tokens[:, 1:, None])], 1).squeeze(-1)
    assert shifted_token_probs(logits, tokens).shape == (3, width)
    assert torch.allclose(shifted_token_probs(logits, tokens), expected)


def test_shifted_token_probs_reads_the_logits_one_position_back():
    logits = log_probs([0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6])  # [T=3, V=3]
    tokens = torch.tensor([1, 2, 0])
    # token 0 reads its own row (p=0.3, never used), token 1 reads row 0 (p(2)=0.2), token 2 row 1 (p(0)=0.1)
    assert shifted_token_probs(logits, tokens).tolist() == pytest.approx([0.3, 0.2, 0.1])
    batched = shifted_token_probs(torch.stack([logits, logits]), torch.stack([tokens, tokens]))  # [2, T]
    assert batched.flatten().tolist() == pytest.approx([0.3, 0.2, 0.1] * 2)


def test_verify_selected_accepts_each_slots_prefix_and_counts_the_global_prefix():
    first_confidence = torch.tensor([0.9, 0.2])
    ar_probs = torch.tensor([[0.0, 0.5, 0.1], [0.0, 0.6, 0.7]])  # column 0 is replaced by the plan's confidence
    v = verify_selected(first_confidence, ar_probs, token_threshold=0.4)
    assert v.slot_accepted.tolist() == [[1, 1, 0], [1, 1, 1]]  # a slot's first token is always accepted
    assert v.prefix_length == 2  # over the concatenation 1 1 0 1 1 1


def test_fast_accept_stops_at_the_first_eos_in_the_prefix():
    drafts = torch.tensor([[5, 6, 7], [8, 2, 9]])
    is_eos = drafts == 2  # EOS at flat index 4
    assert fast_accept(drafts, 5, is_eos) == FastAccept(n_slots=2, last_length=2, eos=True)
    assert fast_accept(drafts, 6, is_eos) == FastAccept(2, 2, True)


def test_fast_accept_takes_whole_slots_once_the_prefix_reaches_a_slot():
    drafts = torch.tensor([[5, 6, 7], [8, 2, 9]])
    is_eos = drafts == 2
    assert fast_accept(drafts, 3, is_eos) == FastAccept(1, 3, False)  # the EOS lies beyond the prefix
    assert fast_accept(drafts, 4, torch.zeros_like(is_eos)) == FastAccept(1, 3, False)
    assert fast_accept(drafts, 6, torch.zeros_like(is_eos)) == FastAccept(2, 3, False)


def test_fast_accept_gives_nothing_below_one_slot():
    drafts = torch.tensor([[5, 6, 7], [8, 2, 9]])
    assert fast_accept(drafts, 2, drafts == 2) is None


def test_force_progress_accepts_right_of_an_accepted_neighbour():
    accept = torch.tensor([[0, 0, 1], [0, 0, 0], [0, 1, 0]]).bool()
    previous = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0]])
    assert force_progress(accept, previous).long().tolist() == [
        [1, 1, 1],  # position 1: its left neighbour was accepted; position 2 by its own probability
        [1, 1, 1],
        [1, 1, 0],  # the first position is always forced
    ]


def test_shared_advance_moves_by_the_smallest_row_and_keeps_one_back_while_incomplete():
    assert shared_advance(torch.tensor([[1, 1, 0], [1, 1, 1]]), all_done=False) == 1
    assert shared_advance(torch.tensor([[1, 1, 1], [1, 1, 1]]), all_done=True) == 3


def test_cut_after_first_eos():
    assert cut_after_first_eos(torch.tensor([0, 0, 1, 0, 1]).bool()).tolist() == [True, True, True, False, False]
    assert cut_after_first_eos(torch.zeros(3, dtype=torch.bool)).tolist() == [True, True, True]


# ------------------------------------------------------------------------------------------- speculative
def test_greedy_accepts_drafts_while_they_equal_the_ar_argmax():
    ar_logits = log_probs([0.1, 0.2, 0.7], [0.1, 0.8, 0.1], [0.3, 0.1, 0.6], [0.5, 0.4, 0.1])  # argmax 2 1 2 0
    drafts = Drafts(torch.tensor([2, 1, 0]))
    assert accepted_and_following(drafts, ar_logits, 0.0, None) == (2, 2)  # the third draft (0) is not the argmax (2)
    # all accepted: the token after the last draft (drafts whose ids the host knows, as copied ones, alike)
    assert accepted_and_following(Drafts(torch.tensor([2, 1, 2])), ar_logits, 0.0, None) == (3, 0)
    assert accepted_and_following(Drafts(torch.tensor([2, 1, 2]), (2, 1, 2)), ar_logits, 0.0, None) == (3, 0)
    assert accepted_and_following(Drafts.none("cpu"), ar_logits[:1], 0.0, None) == (0, 2)


def accepted_and_following(*args) -> tuple[int, int]:
    """accept_drafts' (accepted, following token), after checking that the host's copy of that token is its own."""
    accepted, following, following_id = accept_drafts(*args)
    assert following.shape == (1,) and following.tolist() == [following_id]
    return accepted, following_id


def test_each_positions_noise_depends_on_the_seed_and_the_position_alone():
    noise = PositionNoise(7)
    both = noise.gumbel(3, 2, 50)  # [2, 50]: positions 3 and 4
    noise.gumbel(0, 5, 50)  # draws made in between change nothing
    assert torch.equal(noise.gumbel(4, 1, 50)[0], both[1]) and torch.equal(PositionNoise(7).gumbel(3, 1, 50)[0], both[0])
    assert not torch.equal(both[0], both[1])
    assert not torch.equal(PositionNoise(8).gumbel(3, 1, 50)[0], both[0])
    assert len({position_seed(s, p) for s in range(20) for p in range(20)}) == 400
    assert float(PositionNoise(0).gumbel(0, 1, 20000).mean()) == pytest.approx(0.5772, abs=0.03)  # Euler's gamma


def test_sampling_accepts_a_draft_exactly_when_it_is_its_positions_sample():
    ar_logits = log_probs([0.3, 0.3, 0.4], [0.2, 0.5, 0.3], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8])
    for seed in range(40):
        noise = PositionNoise(seed)
        samples = decided_tokens(ar_logits, 1.0, noise, 10).tolist()  # the tokens of positions 10..13
        drafts = Drafts(torch.tensor([samples[0], samples[1], (samples[2] + 1) % 3]))
        assert accepted_and_following(drafts, ar_logits, 1.0, noise, 10) == (2, samples[2])
        assert accepted_and_following(Drafts(torch.tensor(samples[:3])), ar_logits, 1.0, noise, 10) == (3, samples[3])


def test_sampling_never_accepts_a_token_the_target_never_gives():
    drafts = Drafts(torch.tensor([1, 1]))
    ar_logits = log_probs([0.5, 0, 0.5], [1, 0, 0], [1, 0, 0])  # p(1) = 0 at the first draft
    for seed in range(20):
        accepted, following = accepted_and_following(drafts, ar_logits, 1.0, PositionNoise(seed))
        assert accepted == 0 and following in (0, 2)


def test_sampling_keeps_the_target_distribution_whatever_the_draft():
    # p = (0.5, 0.5, 0) and the draft is always token 0: the first token is 0 or 1, half each, and it is the draft
    # exactly when it is 0
    ar_logits = log_probs([0.5, 0.5, 0.0], [0.0, 0.0, 1.0])
    firsts = []
    for seed in range(500):
        accepted, following = accepted_and_following(Drafts(torch.tensor([0])), ar_logits, 1.0, PositionNoise(seed))
        firsts.append(0 if accepted == 1 else following)
        assert (accepted == 1) == (firsts[-1] == 0) and (accepted == 0 or following == 2)
    assert sum(t == 0 for t in firsts) / len(firsts) == pytest.approx(0.5, abs=0.07)  # 3 sigma
    assert set(firsts) == {0, 1}


def test_sampling_needs_the_sequences_noise():
    with pytest.raises(ValueError, match="PositionNoise"):
        accept_drafts(Drafts(torch.tensor([1])), log_probs([0.5, 0.5], [0.5, 0.5]), 1.0, None)
