"""The cost-aware draft count: forward costs by width, acceptance by depth, and the count that maximizes tokens
per second; in the exact mode it changes how many drafts a round verifies, never the output."""

from dataclasses import replace

import pytest
import torch

import refusion
from refusion.decode.acceptance import AcceptanceByDepth, chances
from refusion.decode.costs import (
    LONG_PROBE_CONTEXT,
    ForwardCosts,
    SuccessRate,
    best_draft_count,
    draft_counts,
    drafting_may_pay,
    forward_costs_of,
    fusing_pays,
    measure,
)
from refusion.decode.forward import CachedForward
from refusion.model.setup import plain_setup, prepare
from refusion.model.tiny import TINY_MASK_ID, tiny_model

FLAT = ForwardCosts((1, 32), (1.0, 1.0))
"""Width costs nothing (a GPU, packed AMX products): every draft is worth verifying."""
PER_ROW = ForwardCosts((1, 2, 32), (1.0, 2.0, 32.0))
"""A forward costs what its rows cost: a draft pays only if it is surely accepted."""


def test_forward_costs_interpolate_between_measured_widths_and_extend_past_the_last():
    costs = ForwardCosts((1, 4, 8), (1.0, 1.6, 3.6))
    assert costs.of(1) == 1.0 and costs.of(4) == pytest.approx(1.6)
    assert costs.of(2) == pytest.approx(1.2) and costs.of(6) == pytest.approx(2.6)
    assert costs.of(10) == pytest.approx(4.6)  # the last segment's slope


def test_acceptance_by_depth_counts_only_drafts_verified_after_accepted_ones():
    record = AcceptanceByDepth()
    assert record.rate(1) == 0.5  # nothing seen: the prior
    record.record(drafted=4, accepted=2)  # depths 1 and 2 accepted, 3 rejected, 4 never judged on its own
    record.record(drafted=2, accepted=2)
    assert record.reached == [2, 2, 1] and record.accepted == [2, 2, 0]
    assert record.rate(1) == pytest.approx(3 / 4) and record.rate(3) == pytest.approx(1 / 3)
    assert record.rate(4) == 0.5


def test_the_best_draft_count_maximizes_expected_tokens_per_second():
    unseen = AcceptanceByDepth()
    assert best_draft_count(6, unseen, FLAT) == 6  # free drafts: all of them
    assert best_draft_count(6, unseen, PER_ROW) == 0  # 1.5 tokens for 2 rows' cost: not worth it
    sure = AcceptanceByDepth()
    for _ in range(50):
        sure.record(drafted=3, accepted=3)
    # rates 51/52 at depths 1-3, 1/2 beyond: with forwards costing 1 + 0.25 per draft, the three sure drafts pay
    # (3.9 tokens for 1.75) and a fourth, accepted half the time, does not (4.4 for 2.0 is less than 3.9 / 1.75)
    costs = ForwardCosts((1, 9), (1.0, 3.0))
    assert best_draft_count(8, sure, costs) == 3
    assert best_draft_count(2, sure, costs) == 2  # no more than there are


def test_in_a_batch_the_step_prices_every_sequences_rows():
    """Forwards whose first rows are nearly free (the weights' bytes) and whose rows cost compute beyond 4: alone, a
    sequence verifies its three sure drafts (4 rows); four sequences doing so make a 16-row forward, where the drafts
    cost more than they give, so in a step of 4 each verifies none."""
    sure = AcceptanceByDepth()
    for _ in range(50):
        sure.record(drafted=3, accepted=3)
    costs = ForwardCosts((1, 4, 16, 64), (1.0, 1.1, 5.0, 20.0))
    assert best_draft_count(3, sure, costs) == 3  # 3.9 tokens for 1.1: alone
    offer = tuple((1, c) for c in chances(3, sure))
    assert draft_counts([(1, offer)], [], costs) == [3]
    assert draft_counts([(1, offer)] * 4, [], costs) == [0] * 4  # 15.5 tokens for 5.0 / 4 for 1.1


def test_in_a_batch_the_step_prices_the_padding_to_the_widest_sequence():
    """Real rows nearly free (the weights' bytes), padding priced by `padded_row`. One sequence of four with 7 sure
    drafts verifies them all where padding is free, and none where a padding row costs a step (its 7 drafts would
    pad the three others by 21 rows); four such sequences fill each other's rows and all draft; beside a 6-token
    prefill, which pads the step anyway, the sequence verifies the 5 drafts that fit in its width."""
    sure = AcceptanceByDepth()
    for _ in range(50):
        sure.record(drafted=8, accepted=8)
    chain = tuple((1, c) for c in chances(7, sure))
    free = ForwardCosts((1, 64), (1.0, 1.5))
    costly = replace(free, padded_row=1.0)
    assert costly.of_batch(10, 4, 4) == costly.of(10) + 6.0
    assert replace(free, masking=0.5).of_batch(4, 4, 1) == free.of(4)  # an AR step: no mask
    assert draft_counts([(1, chain)], [1, 1, 1], free) == [7]
    assert draft_counts([(1, chain)], [1, 1, 1], costly) == [0]
    assert draft_counts([(1, chain)] * 4, [], costly) == [7] * 4
    assert draft_counts([(1, chain)], [6, 1, 1], costly) == [5]


def random_costs(rng) -> ForwardCosts:
    """Forward costs of a random machine: widths' seconds growing at random rates, and random batch terms."""
    widths = sorted(rng.sample(range(2, 80), 6))
    seconds = sorted(0.01 + rng.uniform(0.001, 0.01) * w ** rng.uniform(0.2, 1.0) for w in widths)
    return ForwardCosts((1, *widths), (0.01, *seconds), padded_row=rng.choice([0.0, 0.001, 0.004]),
                        masking=rng.choice([0.0, 0.002]), attention=rng.choice([0.0, 1e-6]),
                        probe_context=rng.choice([0, 128]), probe_batch=rng.choice([0, 4]),
                        split_attention=rng.random() < 0.5)


def test_the_step_decision_skips_its_search_only_where_the_search_takes_nothing(monkeypatch):
    """`no_draft_pays` rules a step out without pricing every width's choices: over random batches, offers and costs
    the decision is the full search's, and the shortcut is taken in some of them (the wide batches of a CPU, where
    a draft's row and the others' padding cost more than it gains)."""
    import random

    from refusion.decode import costs as costs_module

    bound, verdicts = costs_module.no_draft_pays, []

    def recorded(*args):
        verdicts.append(bound(*args))
        return verdicts[-1]

    rng, skipped = random.Random(0), 0
    for _ in range(400):
        table = random_costs(rng)
        offers = [(rng.choice([1, 1, 2]), tuple((rng.choice([1, 1, 2]), gain) for gain in
                                                sorted((rng.random() ** 2 for _ in range(rng.randint(1, 5))),
                                                       reverse=True)))
                  for _ in range(rng.randint(1, 8))]
        others, columns = [1] * rng.randint(0, 4), rng.choice([0, 200, 1500])
        verdicts.clear()
        monkeypatch.setattr(costs_module, "no_draft_pays", recorded)
        decided = draft_counts(offers, others, table, columns)
        monkeypatch.setattr(costs_module, "no_draft_pays", lambda *args: False)  # the full search, always
        assert draft_counts(offers, others, table, columns) == decided
        skipped += any(verdicts)
    assert skipped > 20


def test_the_bound_checks_only_where_its_pieces_end_and_answers_as_checking_every_row():
    """`no_draft_pays` checks each block's first and last row and the measured widths between them: over random
    blocks and costs it answers as the check of every row does (the ratio is monotone between those rows)."""
    import random

    from refusion.decode.costs import no_draft_pays

    def every_row(blocks, tokens, plain, costs, base_rows, batch, columns):
        rows, gain = base_rows, 0.0
        for density, _, _, block_rows, _, _ in blocks:
            for _ in range(block_rows):
                rows, gain = rows + 1, gain + density
                if (tokens + gain) / costs.least_of_batch(rows, batch, columns) >= plain * (1 - 1e-9):
                    return False
        return True

    rng, answers = random.Random(2), []
    for _ in range(500):
        table = random_costs(rng)
        batch, columns = rng.randint(1, 12), rng.choice([0, 200, 1500])
        densities = sorted((rng.random() for _ in range(rng.randint(1, 6))), reverse=True)
        blocks = [(d, i, 1, rng.randint(1, 20), 0.0, 0) for i, d in enumerate(densities)]
        plain = batch / table.of_batch(batch, batch, 1, columns)
        args = (blocks, float(batch), plain, table, batch, batch, columns)
        answers.append(no_draft_pays(*args))
        assert answers[-1] == every_row(*args)
    assert 50 < sum(answers) < 450


def test_where_no_draft_of_the_bounds_could_pay_the_search_takes_none():
    """`drafting_may_pay` answers before the drafters are asked: over random batches and costs, wherever it says no,
    the step's decision takes no item of any offer within the bounds (at most the bound's rows, each item's gain per
    row at most its rate), and it says no in some of them, yes in others."""
    import random

    rng, closed, opened = random.Random(1), 0, 0
    for _ in range(300):
        table = random_costs(rng)
        bounds = [(rng.randint(1, 8), rng.uniform(0.2, 1.0)) for _ in range(rng.randint(1, 8))]
        others, columns = [1] * rng.randint(0, 4), rng.choice([0, 200, 1500])
        if drafting_may_pay(bounds, others, table, columns):
            opened += 1
            continue
        closed += 1
        for _ in range(5):  # offers as rich as the bounds allow: every row at the bound's rate, or less
            offers = []
            for rows, rate in bounds:
                items, left = [], rng.randint(1, rows)
                while left:
                    item_rows = rng.randint(1, left)
                    items.append((item_rows, item_rows * rate * rng.choice([1.0, 1.0, rng.random()])))
                    left -= item_rows
                offers.append((1, tuple(items)))
            assert draft_counts(offers, others, table, columns) == [0] * len(offers)
    assert closed > 20 and opened > 20
    assert drafting_may_pay([(4, 0.9)], [3], PER_ROW)  # beside a wider request drafts are valued otherwise: asked


def test_beside_a_prefill_drafts_are_worth_what_their_rows_cost_in_a_plain_step():
    """A 150-token prefill beside three one-token steps makes a slow step whatever is drafted: at its own rate (4
    tokens over ~240 ms) a draft accepted 4 times in 10 would pay for its 1.6 ms row 25 times over, but at the batch's
    rate in a plain AR step (4 tokens over 12 ms) it gives less than its row's time is worth there, so none is
    verified; a chain of sure drafts still is. Without the prefill, the step's own rate decides, as before."""
    costs = ForwardCosts((1, 4, 64, 256), (10.0, 12.0, 100.0, 400.0))
    unsure = AcceptanceByDepth()
    for accepted in (0, 0, 1):
        unsure.record(drafted=1, accepted=accepted)
    sure = AcceptanceByDepth()
    for _ in range(50):
        sure.record(drafted=4, accepted=4)
    offer, chain = (tuple((1, c) for c in chances(4, a)) for a in (unsure, sure))
    assert unsure.rate(1) == pytest.approx(0.4)
    row = costs.of(154) - costs.of(153)
    assert (4 + 0.4) / (costs.of(153) + row) > 4 / costs.of(153)  # the step's own rate would take it
    assert 4 / costs.of(4) * row > 0.4  # what its row's time gives in a plain step
    assert draft_counts([(1, offer)], [150, 1, 1], costs) == [0]
    assert draft_counts([(1, chain)], [150, 1, 1], costs) == [4]
    assert draft_counts([(1, offer)], [1, 1, 1], costs) == [0]  # 4.4 tokens for 13.5 / 4 for 12
    assert draft_counts([(1, chain)], [1, 1, 1], costs) == [4]


def test_a_longer_layout_and_a_larger_batch_than_the_probe_s_pay_for_their_attention_and_mask():
    """Every row of a forward, padding included, attends over the whole layout: beyond the probe's columns each pays
    `attention` per column; the mask spans every sequence and column, so 4x the probe's columns pay 4x the masking
    and 2x its batch 2x on top; a shorter layout or a smaller batch never pays less than was timed. One sequence of
    four with 3 sure drafts verifies them where the step's layout is the probe's, and none over a 10x longer one."""
    timed = ForwardCosts((1, 64), (1.0, 1.5), padded_row=0.1, masking=0.2, attention=0.001, probe_context=100,
                         probe_batch=4)
    base = timed.of(10)
    assert timed.of_batch(10, 4, 4, columns=100) == pytest.approx(base + 0.1 * 6 + 0.2)
    assert timed.of_batch(10, 4, 4, columns=400) == pytest.approx(base + 0.1 * 6 + 0.001 * 16 * 300 + 0.8)
    assert timed.of_batch(10, 8, 4, columns=400) == pytest.approx(base + 0.1 * 22 + 0.001 * 32 * 300 + 0.8 * 2)
    assert timed.of_batch(10, 2, 8, columns=50) == timed.of_batch(10, 2, 8)  # never below what was timed
    assert timed.of_batch(4, 4, 1, columns=400) == pytest.approx(timed.of(4) + 0.001 * 4 * 300)  # AR: no mask
    unscaled = replace(timed, probe_context=0, probe_batch=0)
    assert unscaled.of_batch(10, 8, 4, 400) == pytest.approx(base + 2.2 + 0.2)
    sure = AcceptanceByDepth()
    for _ in range(50):
        sure.record(drafted=4, accepted=4)
    chain = tuple((1, c) for c in chances(3, sure))
    cheap = replace(timed, padded_row=0.01, masking=0.02, attention=0.0001)
    assert draft_counts([(1, chain)], [1, 1, 1], cheap, columns=100) == [3]  # 6.9 tokens for 1.16 / 4 for 1.02
    assert draft_counts([(1, chain)], [1, 1, 1], cheap, columns=1000) == [0]  # 6.9 tokens for 2.78 / 4 for 1.38


def test_where_attention_runs_row_by_row_only_the_real_queries_pay_for_the_layout():
    """With `split_attention` (the compact forward's sdpa on a CPU), a forward that
    `attention_split.splits_attention` splits pays the per-column attention for its real rows alone: a 143-token
    prefill beside three one-token steps over 1,500 columns pays for 146 queries, not 572; one that does not split
    (one-token steps) pays as before."""
    timed = ForwardCosts((1, 64), (1.0, 1.5), padded_row=0.1, masking=0.2, attention=0.001, probe_context=100,
                         probe_batch=4)
    split = replace(timed, split_attention=True)
    padded = timed.of_batch(146, 4, 143, columns=1500)
    assert split.of_batch(146, 4, 143, columns=1500) == pytest.approx(padded - 0.001 * (572 - 146) * 1400)
    assert split.of_batch(4, 4, 1, columns=1500) == timed.of_batch(4, 4, 1, columns=1500)
    assert ForwardCosts.from_dict(split.to_dict()) == split
    with pytest.raises(ValueError, match="true or false"):
        ForwardCosts.from_dict({**split.to_dict(), "split_attention": 1})


def test_the_probe_prices_a_padding_row_of_a_batch():
    model = tiny_model("llama")
    costs = measure(model, plain_setup(model), widths=(1, 4, 16), repeats=2)
    assert costs.padded_row >= 0 and costs.masking >= 0 and ForwardCosts.from_dict(costs.to_dict()) == costs
    assert (costs.probe_context, costs.probe_batch) == (128, 4)  # the layout the extras were timed on
    assert costs.split_attention  # the tiny model's compact forward runs sdpa on the CPU


def test_a_slow_width_is_pooled_with_its_neighbours_not_carried_to_every_wider_one():
    from refusion.decode.costs import non_decreasing

    assert non_decreasing([28.0, 30.0, 53.0, 41.0, 41.0, 45.0, 60.0]) == pytest.approx([28, 30, 45, 45, 45, 45, 60])
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing([5.0, 4.0]) == [4.5, 4.5]


def test_measured_costs_are_one_per_probed_width_and_never_fall_with_width():
    model = tiny_model("llama")
    costs = measure(model, plain_setup(model), widths=(1, 4, 16), repeats=2)
    assert costs.widths == (1, 4, 16) and len(costs.seconds) == 3
    assert all(a <= b for a, b in zip(costs.seconds, costs.seconds[1:])) and costs.seconds[0] > 0
    prepared = tiny_model("llama")
    setup = prepare(prepared)  # prepare times nothing: the decoder reads the record (measured once)
    assert setup.forward_costs is None and setup.recorded_costs
    assert forward_costs_of(prepared, setup) is not None


def test_a_forward_the_machine_slowed_does_not_price_the_width(monkeypatch):
    """The probe keeps each width's fastest forward: one slowed forward (another process, the OS) among the timed
    ones leaves the costs as the kernels make them (with a median of two it doubled the price of 16 rows)."""
    clock, calls, forward = [0.0], {}, CachedForward.__call__

    def clocked(self, cache, input_ids, *args):  # a fixed time per row, except the second timed forward of 16 rows
        width = input_ids.shape[1]
        index = calls[width] = calls.get(width, -1) + 1
        clock[0] += 0.010 + 0.001 * width + (0.050 if width == 16 and index == 2 else 0)
        return forward(self, cache, input_ids, *args)

    monkeypatch.setattr(CachedForward, "__call__", clocked)
    monkeypatch.setattr("refusion.decode.costs.time.perf_counter", lambda: clock[0])
    model = tiny_model("llama")
    costs = measure(model, plain_setup(model), widths=(1, 4, 16), context=8)
    assert costs.seconds == pytest.approx((0.011, 0.014, 0.026))


def clocked_forwards(monkeypatch, slow_one_token_calls: set[int]) -> None:
    """Forwards that take 1 ms plus 1 ms a row on a fake clock, and 1 s for the one-token forwards whose index (0:
    the first) is in `slow_one_token_calls`."""
    clock, calls, forward = [0.0], {}, CachedForward.__call__

    def clocked(self, cache, input_ids, *args):
        width = input_ids.shape[1]
        index = calls[width] = calls.get(width, -1) + 1
        clock[0] += 0.001 + 0.001 * width + (1.0 if width == 1 and index in slow_one_token_calls else 0)
        return forward(self, cache, input_ids, *args)

    monkeypatch.setattr(CachedForward, "__call__", clocked)
    monkeypatch.setattr("refusion.decode.costs.time.perf_counter", lambda: clock[0])


def test_one_slow_first_forward_is_timed_again_before_drafts_go_unpriced(monkeypatch):
    """The first timed one-token forward slowed (another process starting beside it): timed once more after another
    untimed one, the drafts are priced (before, "not priced" was recorded for good)."""
    clocked_forwards(monkeypatch, slow_one_token_calls={1})  # 0: untimed, 1: the first timed one
    model = tiny_model("llama")
    costs = measure(model, plain_setup(model), widths=(1, 4), repeats=1, context=8)
    assert costs is not None and costs.seconds[0] == pytest.approx(0.002)


def test_forwards_slow_twice_leave_drafts_unpriced_and_say_so(monkeypatch, caplog):
    from refusion.decode import cli, costs

    clocked_forwards(monkeypatch, slow_one_token_calls={1, 3})
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="refusion"):
        assert measure(model, plain_setup(model), widths=(1, 4), repeats=1, context=8) is None
    assert [r.getMessage() for r in caplog.records if "drafts not priced" in r.getMessage()]
    prepared = tiny_model("llama")
    setup = prepare(prepared)
    monkeypatch.setattr(costs, "forward_costs_of", lambda model, setup: None)  # as recorded after such a probe
    line = cli.setup_line(prepared, refusion.DecodeConfig(strategy="speculative"))
    assert line.endswith("drafts not priced (a slow one-token forward: every draft verified)")
    assert "priced" not in cli.setup_line(prepared, refusion.DecodeConfig(strategy="autoregressive"))
    assert "priced" not in setup.describe() and "priced" not in setup.describe(drafts_priced=True)


def test_the_cost_aware_count_changes_the_drafts_never_the_output():
    """Flat costs verify every copied draft (as without costs), per-row costs verify none; both decode AR's
    tokens."""
    model = tiny_model("qwen3")
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3, 4, 3], [12, 13, 14, 15, 16]]
    ar = refusion.generate(model, prompts, max_new_tokens=24, strategy="autoregressive", eos_token_id=2).sequences
    cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=0, lookup_length=6,
                                eos_token_id=2)
    runs = {}
    for name, costs in (("unmeasured", None), ("flat", FLAT), ("per_row", PER_ROW)):
        setup = plain_setup(model).replace(forward_costs=costs)
        out = refusion.generate(model, prompts, cfg, setup=setup, trace=True)
        assert out.sequences == ar, name
        runs[name] = out
    drafted = {name: sum(s.drafted for s in out.stats.per_sequence) for name, out in runs.items()}
    assert drafted["flat"] == drafted["unmeasured"] > 0
    assert runs["flat"].traces == runs["unmeasured"].traces
    assert drafted["per_row"] == 0


def test_a_step_where_no_draft_could_pay_asks_no_drafter_and_decides_as_the_full_decision(monkeypatch):
    """Three sequences decoded together, with costs under which drafts pay in some steps and no draft can in others:
    the step's bound (`drafting_may_pay`) turns drafting off in the latter, the drafters are asked less, and every
    sequence's tokens, drafts, forwards and rounds are those of the decision without the bound (a bound 0.6x as
    high differs from it)."""
    from refusion.decode import loop
    from refusion.decode.drafters.prompt_lookup import PromptLookup

    model = tiny_model("qwen3")
    costs = ForwardCosts((1, 2, 4, 8, 32), (1.0, 1.4, 2.0, 4.0, 16.0))
    setup = plain_setup(model).replace(forward_costs=costs)
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3, 4, 3], [12, 13, 14, 15, 16, 12, 13, 14]]
    base = refusion.DecodeConfig(strategy="speculative", draft_length=0, lookup_length=6, eos_token_id=[])
    real, answers, asked = loop.drafting_may_pay, [], []
    propose = PromptLookup.propose

    def counted(self, context):
        asked.append(context.batch)
        return propose(self, context)

    monkeypatch.setattr(PromptLookup, "propose", counted)

    def decode(gate) -> list:
        monkeypatch.setattr(loop, "drafting_may_pay", gate)
        decoder = loop.Decoder(model, setup=setup)
        seqs = [decoder.add(p, base.replace(max_new_tokens=n), mask_token_id=TINY_MASK_ID, eos_token_ids=[],
                            trace=True)
                for p, n in zip(prompts, (6, 12, 30))]
        decoder.run()
        return [(s.response(), s.stats.forwards, s.stats.drafted, s.stats.accepted, s.rounds) for s in seqs]

    def recorded(*args):
        answers.append(real(*args))
        return answers[-1]

    bounded = decode(recorded)
    asked_with_bound, asked[:] = list(asked), []
    assert bounded == decode(lambda *args: True)
    assert False in answers and True in answers
    assert sum(s[2] for s in bounded) > 0  # drafts were verified once one sequence was left
    assert len(asked_with_bound) < len(asked)  # and the drafters were not asked while none could pay


def test_the_probe_times_decoding_forwards_after_a_cached_context(monkeypatch):
    """The probe's forwards are a decoder's: a one-token check (after an untimed one), the context's prefill, then each timed width at the
    positions after the context, over a cache holding the context alone (what the exact mode's verify forwards see)."""
    model = tiny_model("llama")
    seen = []
    forward = CachedForward.__call__

    def spy(self, cache, input_ids, positions, *args):
        seen.append((input_ids.shape[1], int(positions[0, 0]), cache.committed[0]))
        logits, seconds = forward(self, cache, input_ids, positions, *args)
        assert logits[0].shape[0] == input_ids.shape[1]  # every row's logits, as a verify forward returns
        return logits, seconds

    monkeypatch.setattr(CachedForward, "__call__", spy)
    costs = measure(model, plain_setup(model), widths=(1, 4, 16), repeats=2, context=24)
    assert costs.widths == (1, 4, 16)
    assert seen[:3] == [(1, 0, 0), (1, 0, 0), (24, 0, 0)]  # untimed, timed, the context
    assert seen[3:12] == [(w, 24, 24) for w in (1, 4, 16)] * 3  # an untimed round, then two timed ones
    # batch extras: four sequences' contexts, then one token each, the first holding 2, 16 (the others 1), 3 rounds
    assert seen[12:22] == [(24, 0, 0)] + [(1, 24, 24), (2, 24, 24), (16, 24, 24)] * 3
    # what a row pays per column beyond the context: 16 tokens after the context and after a long one, interleaved,
    # an untimed round and two timed
    assert seen[22:24] == [(24, 0, 0), (LONG_PROBE_CONTEXT, 0, 0)]
    assert seen[24:] == [(16, 24, 24), (16, LONG_PROBE_CONTEXT, LONG_PROBE_CONTEXT)] * 3
    assert costs.attention >= 0 and costs.probe_context == 24


def test_a_plain_model_measures_nothing():
    model = tiny_model("qwen3", dtype=torch.float64)
    assert plain_setup(model).forward_costs is None and forward_costs_of(model, plain_setup(model)) is None


def test_fused_planning_rides_only_where_its_width_pays():
    """With flat costs the next plan rides on every forward that may end a round (as without costs); where a row
    costs what a forward costs it never pays, and the forwards are the unfused algorithm's; the tokens are the
    same in all three."""
    model = tiny_model("qwen3", dtype=torch.float64)
    prompts = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [12, 13, 14, 15, 16]]
    cfg = refusion.DecodeConfig(max_new_tokens=24, slot_size=2, block_size=8, slot_threshold=0.3,
                                token_threshold=0.2, eos_token_id=2)
    unfused = refusion.generate(model, prompts, cfg.replace(fused_plan=False), trace=True)
    runs = {name: refusion.generate(model, prompts, cfg, setup=plain_setup(model).replace(forward_costs=costs),
                                    trace=True)
            for name, costs in (("unmeasured", None), ("flat", FLAT), ("per_row", PER_ROW))}
    for name, out in runs.items():
        assert out.sequences == unfused.sequences, name
    forwards = {name: sum(s.forwards for s in out.stats.per_sequence) for name, out in runs.items()}
    assert runs["flat"].traces == runs["unmeasured"].traces
    assert forwards["flat"] < sum(s.forwards for s in unfused.stats.per_sequence)
    assert forwards["per_row"] == sum(s.forwards for s in unfused.stats.per_sequence)
    assert not any(r.fused_plan for rounds in runs["per_row"].traces for r in rounds)


def test_in_a_batch_an_unfused_plan_is_priced_as_padding_in_a_shared_step():
    """A CPU-like curve (rows nearly free up to 16, then paid for): one sequence fuses a 16-mask plan onto an
    8-token forward; four sequences doing the same would fuse under a whole-forward saving (0.73 of extra cost
    against 0.75 x 1.6), but their unfused plans mostly pad steps the others take anyway, so it does not pay;
    where width is free it pays at any batch."""
    costs = ForwardCosts((1, 16, 64, 256), (1.0, 1.1, 1.6, 4.0))
    used = SuccessRate(tries=2, successes=2)  # 3/4
    assert fusing_pays(costs, width=8, plan_width=16, used=used, batch=1)
    assert costs.of(96) - costs.of(32) < used.value * costs.of(64)  # what the whole-forward saving would say
    assert not fusing_pays(costs, width=8, plan_width=16, used=used, batch=4)
    assert fusing_pays(FLAT, width=8, plan_width=16, used=used, batch=4)
    assert fusing_pays(None, width=8, plan_width=16, used=used, batch=4)  # unmeasured: always
