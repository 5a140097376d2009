"""Every branch of plan-and-infill on a scripted-logit model, with hand-derived expectations.

Prompt [5, 6] (positions 0-1); the canvas starts at position 2. `masks[p]` is what a mask at p drafts
(token, confidence); `nexts[p]` is the AR prediction for position p from the clean token at p - 1.
Unscripted positions predict FILLER with probability 0.5. Every case is also decoded by the cache-free
reference decoder, which must agree.
"""

import pytest

import refusion
from refusion.decode.reference import reference_generate

from .conftest import EOS, MASK, ScriptedLM

PROMPT = [5, 6]
WRONG = 20  # a draft the AR verifier rejects


def decode(masks, nexts, **settings):
    """Decode unfused (the hand-derived forward counts below are the paper's algorithm), check it against
    the reference, and check that fused planning gives the same tokens with one forward fewer per fused plan."""
    model = ScriptedLM(masks, nexts)
    cfg = refusion.DecodeConfig(**{"fused_plan": False, **settings})
    out = refusion.generate(model, [PROMPT], cfg, trace=True)
    reference = reference_generate(ScriptedLM(masks, nexts), PROMPT, cfg, MASK, [EOS])
    assert out.sequences[0] == reference
    fused = refusion.generate(ScriptedLM(masks, nexts), [PROMPT], cfg.replace(fused_plan=True), trace=True)
    assert fused.sequences == out.sequences
    saved = sum(r.fused_plan for r in fused.traces[0])
    assert fused.stats.per_sequence[0].forwards == out.stats.per_sequence[0].forwards - saved
    return out, model


CLEAN = dict(masks={2: (10, .95), 3: (11, .6), 4: (12, .95), 5: (13, .6)}, nexts={3: (11, .9), 5: (13, .9)})


def test_fast_accept_commits_every_selected_slot():
    out, model = decode(**CLEAN, max_new_tokens=4, slot_size=2, block_size=4)
    assert out.sequences == [[10, 11, 12, 13]]
    (rnd,) = out.traces[0]
    assert rnd.how == "fast_accept" and [e.start for e in rnd.planned] == [2, 4]
    stats = out.stats.per_sequence[0]
    assert (stats.forwards, stats.rounds, stats.tokens_per_forward) == (2, 1, 2.0)
    assert model.calls[0][0] == [PROMPT + [MASK] * 4]  # first plan forward: prompt + every mask of the block


def test_partial_fast_accept_then_parallel_completion():
    nexts = {3: (11, .9), 5: (13, .1)}  # the second slot's last token is rejected: l = 3, one slot committed
    out, _ = decode(CLEAN["masks"], nexts, max_new_tokens=4, slot_size=2, block_size=4)
    assert out.sequences == [[10, 11, 12, 13]]
    assert [r.how for r in out.traces[0]] == ["fast_accept", "parallel_completion"]
    assert [[e.start for e in r.committed] for r in out.traces[0]] == [[2], [4]]
    assert out.stats.per_sequence[0].forwards == 2 + 4  # plan + verify, then plan + verify + predict + verify


def test_eos_in_fast_accept_cuts_the_slot_and_drops_later_slots():
    masks = {2: (10, .95), 3: (EOS, .6), 4: (12, .95), 5: (13, .6)}
    nexts = {3: (EOS, .9), 5: (13, .9)}
    out, _ = decode(masks, nexts, max_new_tokens=8, slot_size=2, block_size=4)
    assert out.sequences == [[10, EOS]]
    assert out.stats.per_sequence[0].finish_reason == "eos"
    assert out.stats.per_sequence[0].forwards == 2  # the second block is never decoded
    assert out.traces[0][-1].finished


def test_eos_in_fast_accept_keeps_earlier_unselected_slots():
    masks = {2: (10, .5), 3: (11, .5), 4: (EOS, .95), 6: (14, .95), 7: (15, .6)}
    nexts = {3: (11, .9)}
    out, _ = decode(masks, nexts, max_new_tokens=6, slot_size=2, block_size=6)
    assert out.sequences == [[10, 11, EOS]]
    assert [[e.start for e in r.committed] for r in out.traces[0]] == [[4], [2]]


PC_EOS = dict(
    masks={2: (10, .5), 3: (11, .5), 4: (12, .95), 5: (WRONG, .6), 6: (14, .6), 7: (15, .5), 8: (16, .95), 9: (EOS, .6)},
    nexts={3: (11, .9), 5: (13, .9), 7: (15, .9), 9: (EOS, .9)},
)


def test_eos_in_parallel_completion_drops_only_slots_after_it():
    """Selected slots 1 and 3 complete in parallel and slot 3 ends with EOS. Slots 0 and 2 lie before the
    EOS and must still be decoded (the reference script dropped slot 2 and left a hole)."""
    out, _ = decode(**PC_EOS, max_new_tokens=8, slot_size=2, block_size=8)
    assert out.sequences == [[10, 11, 12, WRONG, 14, 15, 16, EOS]]
    first, second, third = out.traces[0]
    assert first.how == "parallel_completion" and first.finished
    assert [e.start for e in first.planned] == [4, 8] and [e.start for e in first.committed] == [4, 8]
    assert [e.start for e in second.committed] == [6] and [e.start for e in third.committed] == [2]
    assert out.stats.per_sequence[0].forwards == 4 + 2 + 2


def test_recompute_costs_one_forward_per_parallel_completion_and_keeps_tokens():
    out, _ = decode(**PC_EOS, max_new_tokens=8, slot_size=2, block_size=8, kv_cache="recompute")
    assert out.sequences == [[10, 11, 12, WRONG, 14, 15, 16, EOS]]
    assert out.stats.per_sequence[0].forwards == 4 + 1 + 2 + 2


def test_one_slot_per_block_plans_only_the_current_block():
    out, model = decode(**CLEAN, max_new_tokens=4, slot_size=2, block_size=2)
    assert out.sequences == [[10, 11, 12, 13]]
    assert [r.block for r in out.traces[0]] == [0, 1]
    assert model.calls[0][0] == [PROMPT + [MASK] * 2]


def test_slot_threshold_one_plans_the_single_best_slot():
    masks = {**CLEAN["masks"], 4: (12, .94)}
    out, _ = decode(masks, CLEAN["nexts"], max_new_tokens=4, slot_size=2, block_size=4, slot_threshold=1.0)
    assert out.sequences == [[10, 11, 12, 13]]
    assert [[e.start for e in r.planned] for r in out.traces[0]] == [[2], [4]]


def test_token_threshold_one_accepts_one_forced_token_per_iteration():
    masks, nexts = {2: (10, .95), 3: (11, .6), 4: (12, .6)}, {3: (11, .9), 4: (12, .9)}
    out, _ = decode(masks, nexts, max_new_tokens=3, slot_size=3, block_size=3, token_threshold=1.0)
    assert out.sequences == [[10, 11, 12]]
    assert out.stats.per_sequence[0].forwards == 2 + 2 * 2  # two completion iterations for k = 3


def test_token_threshold_zero_accepts_every_draft():
    nexts = {3: (11, .01), 5: (13, .01)}
    out, _ = decode(CLEAN["masks"], nexts, max_new_tokens=4, slot_size=2, block_size=4, token_threshold=0.0)
    assert out.sequences == [[10, 11, 12, 13]] and out.traces[0][0].how == "fast_accept"


@pytest.mark.parametrize("max_new_tokens", [1, 3, 5])
def test_canvas_is_rounded_to_slots_and_output_cut_to_max_new_tokens(max_new_tokens):
    masks = {p: (10 + p, .95) for p in range(2, 10)}
    nexts = {p: (10 + p, .9) for p in range(2, 10)}
    out, _ = decode(masks, nexts, max_new_tokens=max_new_tokens, slot_size=2, block_size=4)
    assert out.sequences == [[10 + p for p in range(2, 2 + max_new_tokens)]]
    assert out.stats.per_sequence[0].finish_reason == "length"
