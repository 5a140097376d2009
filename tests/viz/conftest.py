"""Hand-built traces covering every way of committing: fast accept, parallel completion, EOS, speculative, AR."""

from __future__ import annotations

import pytest

from refusion.viz.schema import RoundRecord, SequenceTrace, SlotRecord, TraceDocument

EOS = "<|im_end|>"


def slot(start: int, text: list[str], score: float | None = None) -> SlotRecord:
    return SlotRecord(start, [ord(t[0]) % 60 + 3 for t in text], list(text), score)


def refusion_sequence(index: int = 0) -> SequenceTrace:
    """P=5, k=4, b=8, canvas 16: round 0 fast-accepts @0 (and sends @4 back), round 1 completes @4 in
    parallel, round 2 completes @8 with EOS in parallel, dropping @12."""
    p = 5
    rounds = [
        RoundRecord(0, 0, "fast_accept", 2, [5, 9],
                    [slot(5, list("the "), 0.97), slot(9, list("cot "), 0.93)], [slot(5, list("the "))],
                    phase_forwards={"plan": 1, "verify": 1}),
        RoundRecord(1, 0, "parallel_completion", 4, [9], [slot(9, list("cot "), 0.81)], [slot(9, list("cat "))],
                    phase_forwards={"plan": 1, "verify": 1, "complete": 2}),
        RoundRecord(2, 1, "parallel_completion", 5, [13, 17],
                    [slot(13, list("sat."), 0.95), slot(17, list("zzzz"), 0.91)],
                    [slot(13, ["s", "a", "t", EOS])], finished=True,
                    phase_forwards={"verify": 1, "complete": 4}, fused_plan=True),
    ]
    stats = {"tokens": 12, "forwards": 11, "rounds": 3, "seconds": 0.5, "finish_reason": "eos",
             "tokens_per_forward": 12 / 11, "tokens_per_second": 24.0}
    return SequenceTrace(index, "tell me about cats", p, 16, "the cat sat", [0] * 12, "eos", stats, rounds)


def ar_sequence(index: int = 0) -> SequenceTrace:
    p, text = 3, "hi!\n" + EOS
    tokens = ["h", "i", "!", "\n", EOS]
    rounds = [RoundRecord(i, 0, "autoregressive", 1, [], [], [slot(p + i, [t])], finished=t == EOS)
              for i, t in enumerate(tokens)]
    stats = {"tokens": 5, "forwards": 5, "rounds": 5, "seconds": 0.1, "finish_reason": "eos"}
    return SequenceTrace(index, "say hi", p, 8, text, [0] * 5, "eos", stats, rounds)


def speculative_sequence(index: int = 0) -> SequenceTrace:
    """P=4, canvas 8, drafts of 3: round 0 (prefill + verify) accepts 2 of 3 drafts and commits 3 tokens,
    round 1 accepts none of 3 and commits the model's own token, round 2 commits EOS without a forward."""
    p = 4
    rounds = [
        RoundRecord(0, 0, "speculative", 2, [], [slot(5, list("bcx"))], [slot(4, list("abc"))],
                    phase_forwards={"prefill": 1, "verify": 1}, drafted=3, accepted=2),
        RoundRecord(1, 0, "speculative", 1, [], [slot(8, list("xyz"))], [slot(7, ["d"])],
                    phase_forwards={"verify": 1}, drafted=3, accepted=0),
        RoundRecord(2, 0, "speculative", 0, [], [], [slot(8, [EOS])], finished=True),
    ]
    stats = {"tokens": 5, "forwards": 3, "rounds": 3, "seconds": 0.2, "finish_reason": "eos",
             "phase_forwards": {"prefill": 1, "verify": 2}, "committed_by": {"speculative": 5},
             "drafted": 6, "accepted": 2}
    return SequenceTrace(index, "abc?", p, 8, "abcd", [0] * 5, "eos", stats, rounds)


SETTINGS = {"max_new_tokens": 16, "slot_size": 4, "block_size": 8, "slot_threshold": 0.9, "token_threshold": 0.4,
            "temperature": 0.0, "seed": None, "strategy": "refusion", "kv_cache": "reuse", "canvas_length": 16}


@pytest.fixture
def trace_doc() -> TraceDocument:
    """Two sequences of a batch: the second is shorter (2 rounds)."""
    second = refusion_sequence(1)
    second.prompt = "and dogs?"
    second.rounds = second.rounds[:1] + [second.rounds[2]]
    second.rounds[1].index = 1
    return TraceDocument(SETTINGS, [refusion_sequence(0), second], model="tiny")


@pytest.fixture
def ar_doc() -> TraceDocument:
    return TraceDocument({**SETTINGS, "strategy": "autoregressive", "max_new_tokens": 8, "canvas_length": 8},
                         [ar_sequence(0)], model="tiny")


@pytest.fixture
def speculative_doc() -> TraceDocument:
    settings = {**SETTINGS, "strategy": "speculative", "max_new_tokens": 8, "canvas_length": 8, "draft_length": 3,
                "predraft": False}
    return TraceDocument(settings, [speculative_sequence(0)], model="tiny")
