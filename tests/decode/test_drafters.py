"""The exact mode's drafters (`decode/drafters/`): each proposes drafts from what it is told and learns from the
verdict, with no decoder behind it; and the step's decision of how far each sequence of a batch drafts
(`costs.draft_counts`), which changes forward counts, never the output."""

import pytest

import refusion
from refusion.decode.acceptance import AcceptanceByDepth, expected_tokens
from refusion.decode.costs import (
    ForwardCosts,
    best_draft_count,
    draft_counts,
)
from refusion.decode.drafters import DRAFTERS, DraftContext, PromptLookup, TableDrafter, Verdict, propose
from refusion.decode.loop import Decoder
from refusion.model.draft_table import DraftTable
from refusion.model.setup import plain_setup
from refusion.model.tiny import tiny_model

FLAT = ForwardCosts((1, 32), (1.0, 1.0))
"""Width costs nothing: every draft pays."""
WIDE_BATCH = ForwardCosts((1, 4, 8, 64), (1.0, 1.05, 2.0, 16.0))
"""Rows nearly free up to 4, then paid for: one sequence drafts, eight sharing a step do not (a draft, accepted at
most once, cannot pay for a row that costs an eighth of the step)."""


def test_drafters_need_no_decoder_only_the_text_and_the_verdicts():
    """What an engine's speculative hook would do: build a drafter, propose for token ids, report acceptance."""
    lookup = PromptLookup(4)
    proposal = lookup.propose(DraftContext([1, 2, 3, 4, 5, 2, 3], room=10))
    assert proposal.drafter is lookup and proposal.drafts.ids == (4, 5, 2, 3)
    lookup.observe(Verdict(proposal, accepted=2))
    assert lookup.acceptance.reached == [1, 1, 1] and lookup.acceptance.accepted == [1, 1, 0]
    other = TableDrafter(DraftTable.from_sequences([[7, 8, 9, 7, 8, 9]], orders=(2,), min_count=1), 3)
    other.observe(Verdict(proposal, accepted=2))  # another drafter's verdict teaches it nothing
    assert other.by_depth.reached == [] and sum(other.by_frequency.reached) == 0
    assert not lookup.propose(DraftContext([1, 2, 3], room=10)).drafted


def test_a_round_verifies_the_first_drafter_with_drafts():
    table = DraftTable.from_sequences([[5, 6, 7, 8], [5, 6, 7, 8]], orders=(1,), min_count=1)
    drafters = [PromptLookup(3), TableDrafter(table, 3)]
    assert propose(drafters, DraftContext([1, 5, 6, 9, 5, 6], room=8), 0, "cpu").drafter is drafters[0]  # "5 6" occurred
    chosen = propose(drafters, DraftContext([1, 2, 5], room=8), 0, "cpu")
    assert chosen.drafter is drafters[1] and chosen.drafts.ids == (6, 7, 8)
    assert propose(drafters, DraftContext([1, 2, 4], room=8), 0, "cpu").drafter is None
    assert list(DRAFTERS) == ["lookup", "table", "masks"]


def test_the_table_prices_each_draft_by_its_frequency_and_learns_from_the_verdicts():
    """A draft the table's answers always wrote is priced at 1 and one they wrote 9 times in 10 at 0.9, before any
    verdict; verdicts then move the chances of the drafts stated in the same tenth of frequency, and of no other."""
    table = DraftTable.from_sequences([[1, 2, 3]] * 9 + [[1, 2, 4]], orders=(1,), min_count=1, min_confidence=0.01)
    drafter = TableDrafter(table, 2, runner_up=False)
    proposal = drafter.propose(DraftContext([1], room=4))
    assert proposal.drafts.ids == (2, 3) and proposal.chances == pytest.approx((1.0, 0.9))
    drafter.observe(Verdict(proposal, accepted=0))  # the first, stated at 1.0, was wrong: one of 0.9-1 tried
    again = drafter.propose(DraftContext([1], room=4))
    assert again.chances == pytest.approx((4 / 5, 4 / 5 * 3.6 / 5))  # the prior weighs 4 drafts
    drafter.observe(Verdict(again.cut(1), accepted=1))  # its first draft alone, accepted: one of two
    assert drafter.propose(DraftContext([2], room=4)).chances == pytest.approx([(1 + 3.6) / 6])
    assert drafter.bound(room=4, batch=1) == (2, pytest.approx(0.9))  # 0.8-0.9, unseen, at its top
    in_a_batch = drafter.propose(DraftContext([1], room=4, batch=8))  # by depth: one first draft of two accepted
    assert in_a_batch.chances == pytest.approx(((1 + 1) / (2 + 2), (1 + 1) / (2 + 2) * 1 / 2))
    assert drafter.bound(room=4, batch=8) == (2, pytest.approx(0.5))
    shared = TableDrafter(table, 2, runner_up=False, by_frequency=drafter.by_frequency)  # as a decoder's sequences
    assert shared.propose(DraftContext([2], room=4)).chances == pytest.approx([(1 + 3.6) / 6])


def test_one_sequence_with_one_chain_drafts_as_best_draft_count_says():
    costs = ForwardCosts((1, 4, 16, 64), (1.0, 1.3, 2.5, 9.0))
    for accepted in (0, 1, 3, 5):
        record = AcceptanceByDepth()
        for _ in range(6):
            record.record(6, accepted)
        chances = [expected_tokens(i, record) - expected_tokens(i - 1, record) for i in range(1, 7)]
        assert draft_counts([(1, tuple((1, c) for c in chances))], [], costs) == [best_draft_count(6, record, costs)]


def test_the_step_takes_the_drafts_that_pay_across_the_batch():
    """Two sequences: one's drafts are nearly sure, the other's seldom accepted. At a CPU-like curve the step
    verifies the sure three, (2 + 2.88) / cost(5) = 3.88 tokens per unit against 3.58 for two of them and 3.66 with
    the other's first draft too; where width is free it verifies all; where a row costs a forward, none."""
    costs = ForwardCosts((1, 4, 16), (1.0, 1.1, 3.0))
    offers = [((1, 0.98), (1, 0.96), (1, 0.94)), ((1, 0.3), (1, 0.09))]
    assert draft_counts([(1, o) for o in offers], [], costs) == [3, 0]
    assert draft_counts([(1, o) for o in offers], [], FLAT) == [3, 2]
    assert draft_counts([(1, o) for o in offers], [], ForwardCosts((1, 2, 32), (1.0, 2.0, 32.0))) == [0, 0]
    assert draft_counts([(1, ()), (1, ())], [], FLAT) == [0, 0]


def test_a_costly_first_item_is_taken_with_the_gain_behind_it():
    """Items are taken in order: a block of mask rows worth 2 tokens behind a weak draft is bought with it."""
    costs = ForwardCosts((1, 8), (1.0, 1.7))  # 0.1 per row
    assert draft_counts([(1, ((1, 0.05), (4, 2.0)))], [], costs) == [2]
    assert draft_counts([(1, ((1, 0.05), (4, 0.2)))], [], costs) == [0]


PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3, 4, 3], [9], [12, 13, 14, 15, 16], [1, 5, 7, 9],
           [20, 21, 22, 20, 21], [30, 31], [4, 4, 4, 4]]


def exact_setups(model, ar):
    table = DraftTable.from_sequences([p[-3:] + s for p, s in zip(PROMPTS, ar)], min_count=1)
    return plain_setup(model).replace(draft_table=table)


@pytest.mark.parametrize("costs", [FLAT, WIDE_BATCH], ids=["free_width", "wide_batch"])
def test_batches_decoded_with_the_step_decision_are_each_prompt_alone_with_ar(costs):
    model = tiny_model("qwen3")
    cfg = refusion.DecodeConfig(max_new_tokens=20, strategy="autoregressive", eos_token_id=2)
    ar = [refusion.generate(model, [p], cfg).sequences[0] for p in PROMPTS]
    setup = exact_setups(model, ar).replace(forward_costs=costs)
    for exact in (dict(draft_length=0, lookup_length=8, table_length=16), dict(draft_length=2, lookup_length=4),
                  dict(draft_length=2, predraft=True)):
        for size in (2, 5, 8):
            out = refusion.generate(model, PROMPTS[:size], cfg.replace(strategy="speculative", **exact), setup=setup)
            assert out.sequences == ar[:size], (exact, size)


def test_a_decoder_s_sequences_price_the_table_s_drafts_by_one_record():
    """Prompts decoded one after another in one decoder: each sequence's table drafter records its verdicts in the
    decoder's record (`Decoder.table_acceptance`), which prices the next sequence's drafts; the answers stay AR's."""
    model = tiny_model("qwen3")
    cfg = refusion.DecodeConfig(max_new_tokens=20, strategy="autoregressive", eos_token_id=2)
    ar = [refusion.generate(model, [p], cfg).sequences[0] for p in PROMPTS]
    decoder = Decoder(model, setup=exact_setups(model, ar).replace(forward_costs=FLAT))
    spec = cfg.replace(strategy="speculative", draft_length=0, lookup_length=0, table_length=16)
    verified = []
    for prompt, answer in zip(PROMPTS, ar):
        seq = decoder.add(prompt, spec, mask_token_id=None, eos_token_ids=[2])
        while decoder.live:
            decoder.step()
        assert seq.response() == answer
        verified.append(sum(decoder.table_acceptance.reached))
    assert verified == sorted(verified) and 0 < verified[0] < verified[-1]


def test_sampled_text_depends_on_the_seed_alone_not_on_the_step_decision():
    """At temperature > 0 the exact mode's text is AR sampling's at the same seed whatever the step verified: forward
    costs that make a batch draft everything, nothing, or a sequence alone draft, and every batch size."""
    model = tiny_model("qwen3")
    cfg = refusion.DecodeConfig(max_new_tokens=16, strategy="autoregressive", eos_token_id=[], temperature=1.0,
                                seed=11)
    ar = refusion.generate(model, PROMPTS, cfg).sequences
    setup = exact_setups(model, ar)
    for exact in (dict(draft_length=0, lookup_length=8, table_length=16), dict(draft_length=2, lookup_length=4)):
        spec = cfg.replace(strategy="speculative", **exact)
        drafted = set()
        for costs in (FLAT, WIDE_BATCH, None):
            for size in (1, 8):
                out = refusion.generate(model, PROMPTS[:size], spec, setup=setup.replace(forward_costs=costs))
                assert out.sequences == ar[:size], (exact, costs, size)
                drafted.add(sum(s.drafted for s in out.stats.per_sequence))
        assert len(drafted) > 2  # the steps verified different drafts


def test_where_width_is_expensive_a_batch_drafts_nothing_and_takes_ar_s_forwards():
    model = tiny_model("qwen3")
    cfg = refusion.DecodeConfig(max_new_tokens=16, strategy="autoregressive", eos_token_id=[])
    ar = refusion.generate(model, PROMPTS, cfg)
    setup = exact_setups(model, ar.sequences)
    for exact in (dict(draft_length=0, lookup_length=8, table_length=16), dict(draft_length=3, lookup_length=4)):
        spec = cfg.replace(strategy="speculative", **exact)
        wide = refusion.generate(model, PROMPTS, spec, setup=setup.replace(forward_costs=WIDE_BATCH))
        assert wide.sequences == ar.sequences
        assert sum(s.drafted for s in wide.stats.per_sequence) == 0
        assert [s.forwards for s in wide.stats.per_sequence] == [s.forwards for s in ar.stats.per_sequence]
        assert wide.stats.batch.forwards == ar.stats.batch.forwards
        free = refusion.generate(model, PROMPTS, spec, setup=setup.replace(forward_costs=FLAT))
        assert free.sequences == ar.sequences and sum(s.drafted for s in free.stats.per_sequence) > 0
        assert sum(s.forwards for s in free.stats.per_sequence) < sum(s.forwards for s in ar.stats.per_sequence)
        alone = refusion.generate(model, PROMPTS[:1], spec, setup=setup.replace(forward_costs=WIDE_BATCH))
        assert alone.sequences == ar.sequences[:1] and alone.stats.per_sequence[0].drafted > 0  # alone it pays
