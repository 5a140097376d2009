"""`DecodeConfig.logprobs`: each committed token's log-probability, from the distribution that committed it.

AR and the exact mode are checked against an independent oracle (a plain forward of the prompt and the tokens
before each one, in float64); plan and infill on the scripted-logit model, whose every distribution is known."""

import math

import pytest
import torch

import refusion
from refusion.config import ConfigError
from refusion.model.tiny import tiny_model

from .conftest import EOS, ScriptedLM
from .test_scripted import CLEAN, PC_EOS, PROMPT, WRONG

PROMPTS = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9], [12, 13, 14, 15, 16]]
EXACT = [dict(draft_length=1), dict(draft_length=3), dict(draft_length=2, predraft=True),
         dict(draft_length=0, lookup_length=4), dict(draft_length=4, draft_threshold=0.5)]


@pytest.fixture(scope="module")
def model64():
    return tiny_model("qwen3", dtype=torch.float64)


def oracle(model, prompt: list[int], response: list[int], top: int):
    """(logprobs, top ids, top logprobs) of each response token by one plain forward of prompt + response."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1: -1].double(), -1)  # [n, V]
    chosen = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    values, indices = logp.topk(top, -1)
    return chosen.tolist(), indices.tolist(), values.tolist()


def assert_matches_oracle(model, prompts, out, top):
    for prompt, sequence, logprobs in zip(prompts, out.sequences, out.logprobs):
        assert [lp.token for lp in logprobs] == sequence
        chosen, ids, values = oracle(model, prompt, sequence, top)
        assert [lp.logprob for lp in logprobs] == pytest.approx(chosen, abs=1e-9)
        assert [[i for i, _ in lp.top] for lp in logprobs] == ids
        assert [v for lp in logprobs for _, v in lp.top] == pytest.approx(sum(values, []), abs=1e-9)


@torch.inference_mode()
def test_autoregressive_logprobs_are_the_models_distribution(model64):
    out = refusion.generate(model64, PROMPTS, max_new_tokens=16, strategy="autoregressive", eos_token_id=EOS,
                            logprobs=5)
    assert_matches_oracle(model64, PROMPTS, out, 5)


@torch.inference_mode()
@pytest.mark.parametrize("settings", EXACT, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_exact_mode_logprobs_equal_autoregressive_decodings(model64, settings):
    cfg = refusion.DecodeConfig(max_new_tokens=16, eos_token_id=EOS, logprobs=4)
    ar = refusion.generate(model64, PROMPTS, cfg.replace(strategy="autoregressive"))
    exact = refusion.generate(model64, PROMPTS, cfg.replace(strategy="speculative", **settings))
    assert exact.sequences == ar.sequences
    for ours, theirs in zip(exact.logprobs, ar.logprobs):
        assert [lp.token for lp in ours] == [lp.token for lp in theirs]
        assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-9)
        assert [[i for i, _ in lp.top] for lp in ours] == [[i for i, _ in lp.top] for lp in theirs]


@torch.inference_mode()
def test_tokens_committed_from_a_runner_up_chain_report_ar_decoding_s_logprobs(model64):
    from refusion.model.setup import setup_of
    from tests.model.test_draft_table import runner_up_table

    cfg = refusion.DecodeConfig(max_new_tokens=16, eos_token_id=EOS, logprobs=4)
    ar = refusion.generate(model64, PROMPTS, cfg.replace(strategy="autoregressive"))
    setup = setup_of(model64).replace(draft_table=runner_up_table(PROMPTS, ar.sequences, model64.config.vocab_size))
    exact = [refusion.generate(model64, [p], cfg.replace(strategy="speculative", draft_length=0, table_length=4),
                               setup=setup, trace=True) for p in PROMPTS]  # alone: a batch verifies one chain
    assert [out.sequences[0] for out in exact] == ar.sequences
    assert any(len(r.planned) == 2 and len(r.committed[0].tokens) > 1 for out in exact for r in out.traces[0])
    for ours, theirs in zip([out.logprobs[0] for out in exact], ar.logprobs):
        assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-9)
        assert [[i for i, _ in lp.top] for lp in ours] == [[i for i, _ in lp.top] for lp in theirs]


@torch.inference_mode()
@pytest.mark.parametrize("strategy", ["autoregressive", "speculative"])
def test_sampled_tokens_report_the_untempered_distribution(model64, strategy):
    out = refusion.generate(model64, PROMPTS, max_new_tokens=12, strategy=strategy, eos_token_id=EOS, logprobs=3,
                            temperature=1.5, seed=7)
    assert_matches_oracle(model64, PROMPTS, out, 3)


@pytest.mark.parametrize("strategy", ["autoregressive", "speculative", "refusion"])
def test_greedy_token_tops_its_sorted_alternatives_and_batch_equals_alone(strategy):
    model = tiny_model("llama")
    slots = dict(slot_size=4, block_size=8) if strategy == "refusion" else {}
    cfg = refusion.DecodeConfig(max_new_tokens=16, strategy=strategy, eos_token_id=EOS, logprobs=5, **slots)
    out = refusion.generate(model, PROMPTS, cfg)
    for sequence, logprobs in zip(out.sequences, out.logprobs):
        assert len(logprobs) == len(sequence) and [lp.token for lp in logprobs] == sequence
        for lp in logprobs:
            values = [v for _, v in lp.top]
            assert len(lp.top) == 5 and values == sorted(values, reverse=True)
            assert all(v <= 0 for v in values) and math.isfinite(lp.logprob)
            assert lp.logprob <= values[0] + 1e-6
            if strategy != "refusion":  # greedy from this very distribution
                assert lp.top[0][0] == lp.token and lp.logprob == values[0]
    for i, prompt in enumerate(PROMPTS):
        alone = refusion.generate(model, [prompt], cfg)
        assert alone.sequences[0] == out.sequences[i]
        assert [lp.logprob for lp in alone.logprobs[0]] == pytest.approx([lp.logprob for lp in out.logprobs[i]],
                                                                         abs=1e-5)


def test_off_by_default_and_zero_reports_the_token_alone():
    model = tiny_model("qwen3")
    assert refusion.generate(model, PROMPTS[:1], max_new_tokens=8).logprobs is None
    for strategy in ("autoregressive", "speculative", "refusion"):
        out = refusion.generate(model, PROMPTS, max_new_tokens=8, strategy=strategy, logprobs=0)
        for sequence, logprobs in zip(out.sequences, out.logprobs):
            assert [lp.token for lp in logprobs] == sequence and all(lp.top == [] for lp in logprobs)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_logprobs_is_validated(value):
    with pytest.raises(ConfigError, match="logprobs"):
        refusion.DecodeConfig(logprobs=value)


# ----------------------------------------------------------------------------- plan and infill, scripted
def scripted_logprobs(masks, nexts, **settings) -> tuple[list[int], list[float]]:
    out = refusion.generate(ScriptedLM(masks, nexts), [PROMPT], refusion.DecodeConfig(logprobs=2, **settings))
    return out.sequences[0], [lp.logprob for lp in out.logprobs[0]]


@pytest.mark.parametrize("fused_plan", [False, True])
def test_fast_accept_reports_the_plan_for_first_tokens_and_the_verify_forward_after(fused_plan):
    tokens, logprobs = scripted_logprobs(**CLEAN, max_new_tokens=4, slot_size=2, block_size=4, fused_plan=fused_plan)
    assert tokens == [10, 11, 12, 13]
    # slot starts 2 and 4: the plan's masked distribution; 3 and 5: the verify forward's AR distribution
    assert logprobs == pytest.approx([math.log(p) for p in (.95, .9, .95, .9)], rel=1e-5)


@pytest.mark.parametrize("kv_cache", ["reuse", "recompute"])
def test_parallel_completion_reports_the_forward_that_decided_each_token(kv_cache):
    tokens, logprobs = scripted_logprobs(**PC_EOS, max_new_tokens=8, slot_size=2, block_size=8, kv_cache=kv_cache)
    assert tokens == [10, 11, 12, WRONG, 14, 15, 16, EOS]
    # round 1 completes slots 4 and 8 in parallel: 12 and 16 from the plan, EOS accepted by the verify forward
    # (AR .9), WRONG rejected by it (AR 0.1 / 31) and then forced: its masked prediction's .6; round 2 fast accepts
    # slot 6 (14: the plan's .6, 15: AR .9), round 3 slot 2 (10: the plan's .5, 11: AR .9)
    assert logprobs == pytest.approx([math.log(p) for p in (.5, .9, .95, .6, .6, .9, .95, .9)], rel=1e-5)


def test_a_completion_iteration_reports_its_verify_forward_for_tokens_it_accepts():
    masks, nexts = {2: (10, .95), 3: (WRONG, .6), 4: (12, .6)}, {3: (11, .9), 4: (12, .9)}
    tokens, logprobs = scripted_logprobs(masks, nexts, max_new_tokens=3, slot_size=3, block_size=3)
    assert tokens == [10, WRONG, 12]
    # the round's verify forward rejects WRONG (and so 12 after it); the completion iteration forces WRONG (its
    # masked prediction's .6) and accepts 12 by its own verify forward (AR .9)
    assert logprobs == pytest.approx([math.log(p) for p in (.95, .6, .9)], rel=1e-5)
