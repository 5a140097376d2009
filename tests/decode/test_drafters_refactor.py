"""TEMPORARY: the exact mode's program on its drafters (`decode/drafters/`) decodes exactly as the program before
them: the same tokens, traces (drafts verified and accepted, round by round), logprobs and forward counts."""

import random

import pytest

import refusion
from refusion.decode.costs import ForwardCosts
from refusion.decode.programs import PROGRAMS
from refusion.decode.programs._speculative_before import speculative_program_before
from refusion.decode.programs.speculative import speculative_program
from refusion.model.draft_table import DraftTable
from refusion.model.setup import plain_setup
from refusion.model.tiny import tiny_model

COSTS = [None, ForwardCosts((1, 32), (1.0, 1.0)), ForwardCosts((1, 2, 32), (1.0, 2.0, 32.0)),
         ForwardCosts((1, 4, 16, 64), (1.0, 1.1, 2.0, 8.0))]


def decode(model, prompts, cfg, setup, program, monkeypatch):
    monkeypatch.setitem(PROGRAMS, "speculative", program)
    return refusion.generate(model, prompts, cfg, setup=setup, trace=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_program_on_drafters_decodes_as_the_one_before(arch, monkeypatch):
    model = tiny_model(arch)
    rng = random.Random(f"drafters-{arch}")
    prompts_pool = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3, 4, 3], [9], [12, 13, 14, 15, 16], [1, 5, 7, 9]]
    ar = refusion.generate(model, prompts_pool, max_new_tokens=24, strategy="autoregressive",
                           eos_token_id=2).sequences
    tables = [None, DraftTable.from_sequences([p[-3:] + s for p, s in zip(prompts_pool, ar)], min_count=1),
              DraftTable((2,), 0.5, {tuple(s[i:i + 2]): ((s[i + 2] + 1) % 64, 0.9) for s in ar
                                     for i in range(len(s) - 2)},
                         {tuple(s[i:i + 2]): s[i + 2] for s in ar for i in range(len(s) - 2)})]
    seconds = 0
    for trial in range(40):
        cfg = refusion.DecodeConfig(
            strategy="speculative", max_new_tokens=rng.choice([1, 2, 7, 24]), eos_token_id=rng.choice([2, [2, 36], []]),
            draft_length=rng.choice([0, 0, 1, 3]), predraft=rng.random() < 0.3,
            draft_threshold=rng.choice([0.0, 0.0, 0.3]), lookup_length=rng.choice([0, 4, 8]),
            table_length=rng.choice([0, 4, 16]), temperature=rng.choice([0.0, 0.0, 0.0, 1.5]), seed=trial,
            logprobs=rng.choice([None, None, 2]))
        setup = plain_setup(model).replace(draft_table=rng.choice(tables + tables[2:]), forward_costs=rng.choice(COSTS))
        prompts = rng.sample(prompts_pool, rng.choice([1, 1, 2, 4]))
        before = decode(model, prompts, cfg, setup, speculative_program_before, monkeypatch)
        after = decode(model, prompts, cfg, setup, speculative_program, monkeypatch)
        assert after.sequences == before.sequences, (trial, cfg)
        assert after.traces == before.traces, (trial, cfg)
        seconds += sum(len(r.planned) == 2 for rounds in after.traces for r in rounds)
        assert [s.forwards for s in after.stats.per_sequence] == [s.forwards for s in before.stats.per_sequence]
        assert after.stats.batch.forwards == before.stats.batch.forwards
        if cfg.logprobs is not None and cfg.max_new_tokens > 1:  # one token: the prefill no longer carries a mask
            assert after.logprobs == before.logprobs, (trial, cfg)  # that drafts nothing (fp32 rounding differs)
        if cfg.temperature == 0:
            assert after.sequences == [ar[prompts_pool.index(p)][:cfg.max_new_tokens] if cfg.eos_token_id == 2
                                       else after.sequences[i] for i, p in enumerate(prompts)]
    assert seconds > 0  # runner-up chains were verified
