"""The exact mode (strategy="speculative"): its output is AR decoding's, token for token (greedy) and in
distribution (sampling), whatever the drafts; fused planning gives the paper's tokens with fewer forwards."""

import random

import pytest
import torch

import refusion
from refusion.model.tiny import TINY_MASK_ID, tiny_model

from .conftest import EOS, ScriptedLM
from .test_parity import random_settings

ARCHS = ["qwen3", "llama", "qwen2", "mistral"]
PROMPTS = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9], [12, 13, 14, 15, 16]]


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_equals_autoregressive_and_transformers_greedy(arch):
    model = tiny_model(arch)
    ar = refusion.generate(model, PROMPTS, max_new_tokens=24, strategy="autoregressive", eos_token_id=2).sequences
    for prompt, sequence in zip(PROMPTS, ar):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert sequence == expected
    for draft_length in (1, 2, 3, 5, 8):
        for predraft in (False, True):
            cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=draft_length,
                                        predraft=predraft, eos_token_id=2)
            assert refusion.generate(model, PROMPTS, cfg).sequences == ar, (draft_length, predraft)
            assert refusion.generate(model, PROMPTS[1:2], cfg).sequences == ar[1:2]


@pytest.mark.parametrize("draft_threshold", [0.5, 0.8])
def test_a_draft_threshold_never_changes_the_output(draft_threshold):
    model = tiny_model("qwen3")
    ar = refusion.generate(model, PROMPTS, max_new_tokens=24, strategy="autoregressive", eos_token_id=2).sequences
    for draft_length, predraft in ((1, False), (3, False), (2, True)):
        cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=draft_length,
                                    predraft=predraft, eos_token_id=2)
        every = refusion.generate(model, PROMPTS, cfg)
        cut = refusion.generate(model, PROMPTS, cfg.replace(draft_threshold=draft_threshold))
        assert cut.sequences == every.sequences == ar, (draft_length, predraft)
        drafted = [sum(s.drafted for s in out.stats.per_sequence) for out in (cut, every)]
        assert 0 < drafted[0] < drafted[1]  # some drafts were cut, not all


def test_prompt_lookup_copies_what_followed_the_latest_earlier_occurrence():
    from refusion.decode.drafters.prompt_lookup import lookup_drafts

    text = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    assert lookup_drafts(text, 2) == [6, 7]  # "2 3 4" occurred twice: the latest one wins
    assert lookup_drafts(text, 9) == [6, 7, 2, 3, 4]  # up to the end of the text
    assert lookup_drafts([1, 8, 5, 3, 8, 5], 3) == [3, 8, 5]  # no earlier "3 8 5": the last 2 tokens, "8 5"
    assert lookup_drafts([1, 2, 3, 4], 3) == [] and lookup_drafts([4], 3) == []


def test_prompt_lookup_index_answers_as_the_scan_does_as_the_text_grows():
    import random

    from refusion.decode.drafters.prompt_lookup import LatestOccurrences, lookup_drafts

    rng = random.Random(0)
    for _ in range(20):
        occurrences, text = LatestOccurrences(), []
        for step in range(60):
            if step == 30:  # another text (not an extension of the last): indexed afresh
                text = text[:len(text) // 2] + [5]
            else:  # a step commits one to a few tokens
                text = text + [rng.randrange(5) for _ in range(rng.randint(1, 4))]
            length = rng.randint(1, 6)
            assert occurrences.drafts(text, length) == lookup_drafts(text, length), (text, length)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prompt_lookup_never_changes_the_output_and_drafts_from_repetitions(arch):
    model = tiny_model(arch)
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3, 4, 3], [9], [12, 13, 14, 15, 16]]
    ar = refusion.generate(model, prompts, max_new_tokens=24, strategy="autoregressive", eos_token_id=2).sequences
    for draft_length, predraft in ((1, False), (2, True)):
        cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=draft_length,
                                    predraft=predraft, eos_token_id=2)
        masks_only = refusion.generate(model, prompts, cfg)
        lookup = refusion.generate(model, prompts, cfg.replace(lookup_length=4), trace=True)
        assert lookup.sequences == masks_only.sequences == ar, (draft_length, predraft)
        longest = max(len(e.tokens) for rounds in lookup.traces for r in rounds for e in r.planned)
        assert longest > draft_length  # only copied drafts run longer than the masks'


def test_unconfident_drafts_are_not_verified():
    # AR continues 10, 11, ... from positions 2 on; the masks draft it with probability 0.9, except at
    # positions 5 and 9, where they draft a wrong token (20) with probability 0.3
    ar = {p: 8 + p for p in range(2, 12)} | {12: EOS}
    masks = {p: (20, 0.3) if p in (5, 9) else (t, 0.9) for p, t in ar.items()}
    expected = [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, EOS]]
    runs = {}
    for threshold in (0.0, 0.5):
        model = ScriptedLM(masks, {p: (t, 0.9) for p, t in ar.items()})
        out = refusion.generate(model, [[5, 6]], max_new_tokens=20, strategy="speculative", draft_length=3,
                                draft_threshold=threshold, trace=True)
        assert out.sequences == expected
        runs[threshold] = (out.stats.per_sequence[0], [e.tokens for r in out.traces[0] for e in r.planned],
                           max(len(ids[0]) for ids, _ in model.calls[1:]))
    (plain, plain_drafts, _), (gated, gated_drafts, widest) = runs[0.0], runs[0.5]
    assert any(20 in d for d in plain_drafts) and plain.drafted > plain.accepted
    assert not any(20 in d for d in gated_drafts)  # the unlikely drafts were cut, with the ones after them
    assert gated.accepted == gated.drafted > 0  # every draft it verified was right
    assert gated.drafted < plain.drafted and widest <= 1 + 3 + 4


def test_the_draft_cut_reads_the_distribution_not_the_drawn_token():
    """The cut reads each mask's distribution (softmax(logits / T) at temperature T > 0), never the token drawn: a
    drawn token of low probability is kept when its distribution peaks above the threshold."""
    from refusion.decode.drafters.masks import confident_drafts
    from refusion.decode.speculate import Drafts

    probs = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.3, 0.5], [0.9, 0.05, 0.05]])
    drawn = Drafts(torch.tensor([1, 2, 0]))  # the first draft drew a token of probability 0.1
    assert confident_drafts(drawn, probs.log(), 0.6, 1.0).tokens.tolist() == [1]  # cut at the flat second mask
    assert confident_drafts(drawn, probs.log(), 0.5, 1.0).tokens.tolist() == [1, 2, 0]
    assert confident_drafts(drawn, probs.log(), 0.0, 1.0).tokens.tolist() == [1, 2, 0]
    assert confident_drafts(drawn, probs.log(), 0.6, 2.0).tokens.tolist() == []  # flatter at T = 2: 0.8 -> 0.59
    greedy = Drafts(probs.argmax(-1))  # greedy drafts: the peaks of the logits' own softmax
    assert confident_drafts(greedy, probs.log(), 0.85, 0.0).tokens.tolist() == []


def _ar_continuation_model(masks_right: dict[int, bool], ar: dict[int, int]) -> ScriptedLM:
    """Scripted model whose masks draft the AR token (or a wrong one) at each position."""
    nexts = {p: (t, 0.9) for p, t in ar.items()}
    masks = {p: (t if masks_right.get(p, True) else 20, 0.9) for p, t in ar.items()}
    return ScriptedLM(masks, nexts)


@pytest.mark.parametrize("predraft", [False, True])
def test_speculative_accepts_agreeing_drafts_and_stays_exact(predraft):
    # prompt [5, 6] at positions 0-1; AR continues 10, 11, ..., 19 then EOS at position 12
    ar = {p: 8 + p for p in range(2, 12)} | {12: EOS}
    wrong = {5: False, 9: False}  # two drafts disagree: each costs the rest of its chain
    model = _ar_continuation_model(wrong, ar)
    expected = refusion.generate(model, [[5, 6]], max_new_tokens=20, strategy="autoregressive").sequences
    assert expected == [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, EOS]]
    out = refusion.generate(_ar_continuation_model(wrong, ar), [[5, 6]], max_new_tokens=20, strategy="speculative",
                            draft_length=3, predraft=predraft, trace=True)
    assert out.sequences == expected
    stats = out.stats.per_sequence[0]
    assert stats.accepted >= 4 and stats.drafted > stats.accepted
    assert stats.forwards < len(expected[0]) and stats.finish_reason == "eos"
    assert sum(r.forwards for r in out.traces[0]) == stats.forwards
    assert sum(r.tokens for r in out.traces[0]) == len(expected[0])
    if predraft:  # drafts are ready whatever was accepted: every forward after the prefill verifies some
        assert all(r.drafted for r in out.traces[0][:-1])


@pytest.mark.parametrize("predraft", [False, True])
def test_drafts_are_the_masks_predictions_on_top_of_the_accepted_text(predraft):
    """Each round's drafts equal a cache-free forward of prompt + accepted text + masks: the masks of a
    forward read exactly the accepted prefix of the chain (this checks the pre-draft attention groups)."""
    model = tiny_model("qwen3", dtype=torch.float64)
    prompt, draft_length = [1, 5, 7, 9], 3
    out = refusion.generate(model, [prompt], max_new_tokens=20, strategy="speculative", draft_length=draft_length,
                            predraft=predraft, eos_token_id=[], trace=True)
    text = prompt + out.sequences[0]
    checked = 0
    for rnd in out.traces[0]:
        for event in rnd.planned:
            position = event.start - 1  # the round's first token (decided before), then its drafts
            ids = text[:position] + [TINY_MASK_ID] * (draft_length + 1)
            logits = model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits[0]
            expected = logits[position + 1: position + 1 + len(event.tokens)].argmax(-1).tolist()
            assert event.tokens == expected
            checked += 1
    assert checked >= 5


LOOKUP_PROMPT = [t for v in range(64) for t in (9, v)] + [9]  # whatever x1 is, "9 x1" occurred: x2 is drafted as 9


@pytest.mark.parametrize("prompt,lookup_length", [([1, 5, 7, 9], 0), (LOOKUP_PROMPT, 2)])
def test_speculative_sampling_follows_the_autoregressive_distribution(prompt, lookup_length):
    """At temperature > 0 the first two sampled tokens follow AR sampling's distribution: the first token is
    sampled from p(x1), the second goes through the acceptance rule against p(x2 | x1) (drafted by the masks, or
    copied by prompt lookup)."""
    model = tiny_model("qwen3", dtype=torch.float64)
    temperature, n = 3.0, 1500
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        batch = torch.tensor([prompt + [t] for t in range(first.numel())])
        following = torch.softmax(model(batch).logits[:, -1] / temperature, -1)  # [V, V]: p(x2 | x1)
    second = first @ following  # exact marginal of x2
    cfg = refusion.DecodeConfig(max_new_tokens=2, strategy="speculative", draft_length=2, temperature=temperature,
                                seed=0, eos_token_id=[], lookup_length=lookup_length)
    out = refusion.generate(model, [prompt] * n, cfg)
    samples = torch.tensor(out.sequences)  # [n, 2]
    vocab = first.numel()

    def tv(observed: torch.Tensor, exact: torch.Tensor) -> float:
        return 0.5 * float((torch.bincount(observed, minlength=vocab) / n - exact).abs().sum())

    # sampling noise alone gives a TV of ~0.05-0.08 here; a sampler that kept every draft would give the
    # masks' distribution instead (TV 0.51 on this random model)
    assert tv(samples[:, 0], first) < 0.12
    assert tv(samples[:, 1], second) < 0.12
    accepted = sum(s.accepted for s in out.stats.per_sequence)
    if lookup_length:  # every draft was the copied 9 (p(9) is small here: it is seldom accepted)
        assert 0 < accepted < 0.95 * n
        assert all(x2 == 9 for (_, x2), s in zip(out.sequences, out.stats.per_sequence) if s.accepted)
    else:
        assert 0.05 * n < accepted < 0.95 * n  # the acceptance rule ran both ways


@pytest.mark.parametrize("exact", [dict(draft_length=2), dict(draft_length=2, predraft=True, draft_threshold=0.2),
                                   dict(draft_length=0, lookup_length=4), dict(draft_length=3, lookup_length=4)])
def test_speculative_sampling_is_ar_sampling_sample_for_sample(exact):
    """At temperature > 0 each position's token is the Gumbel-max sample with that position's own noise, so the
    exact mode gives AR sampling's text at the same seed, alone or batched, whatever it drafted."""
    model = tiny_model("qwen3", dtype=torch.float64)
    cfg = refusion.DecodeConfig(max_new_tokens=16, strategy="autoregressive", temperature=1.5, seed=3,
                                eos_token_id=[])
    ar = refusion.generate(model, PROMPTS, cfg).sequences
    spec = cfg.replace(strategy="speculative", **exact)
    out = refusion.generate(model, PROMPTS, spec)
    assert out.sequences == ar and sum(s.accepted for s in out.stats.per_sequence) > 0
    assert refusion.generate(model, PROMPTS[:1], spec).sequences == ar[:1]
    assert refusion.generate(model, PROMPTS[1:2], spec.replace(seed=4)).sequences == ar[1:2]  # seed + index
    assert refusion.generate(model, PROMPTS, spec.replace(seed=5)).sequences != ar
    assert ar != refusion.generate(model, PROMPTS, cfg.replace(temperature=0.0)).sequences


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_planning_gives_the_same_tokens_with_fewer_forwards(arch):
    model = tiny_model(arch, dtype=torch.float64)
    rng = random.Random(f"fused-{arch}")
    fused_rounds = 0
    for _ in range(25):
        cfg = refusion.DecodeConfig(**random_settings(rng), fused_plan=False)
        prompts = [[rng.randint(3, 60) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        plain = refusion.generate(model, prompts, cfg)
        fused = refusion.generate(model, prompts, cfg.replace(fused_plan=True), trace=True)
        assert fused.sequences == plain.sequences, cfg
        for p, f, rounds in zip(plain.stats.per_sequence, fused.stats.per_sequence, fused.traces):
            saved = sum(r.fused_plan for r in rounds)
            assert f.forwards == p.forwards - saved and f.phase_forwards.get("plan", 0) == p.phase_forwards["plan"] - saved
            assert sum(r.forwards for r in rounds) == f.forwards
            fused_rounds += saved
    assert fused_rounds > 20


def test_every_forward_is_accounted_for():
    model = tiny_model("qwen3", dtype=torch.float64)
    for strategy in ("refusion", "speculative", "autoregressive"):
        out = refusion.generate(model, PROMPTS, max_new_tokens=20, slot_size=4, block_size=8, slot_threshold=0.5,
                                token_threshold=0.3, strategy=strategy, eos_token_id=[40], trace=True)
        for stats, rounds, sequence in zip(out.stats.per_sequence, out.traces, out.sequences):
            assert sum(stats.phase_forwards.values()) == stats.forwards == sum(r.forwards for r in rounds)
            assert sum(stats.committed_by.values()) >= len(sequence) == stats.tokens
            assert stats.finish_reason == ("eos" if sequence[-1] == 40 else "length")


def test_speculative_needs_a_mask_token_and_validates_draft_length():
    with pytest.raises(ValueError, match="draft_length=-1"):
        refusion.DecodeConfig(strategy="speculative", draft_length=-1)
    model = tiny_model("qwen3")
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask_token_id"):
        refusion.generate(model, [[1, 2]], strategy="speculative")
    # draft_length 0: no masks, the drafts come from the text (prompt lookup): any model, AR's output
    prompts = [[1, 5, 7, 9, 1, 5, 7], [3, 4, 3, 4, 3]]
    ar = refusion.generate(model, prompts, max_new_tokens=16, strategy="autoregressive", eos_token_id=2)
    cfg = refusion.DecodeConfig(max_new_tokens=16, strategy="speculative", draft_length=0, lookup_length=4,
                                eos_token_id=2)
    out = refusion.generate(model, prompts, cfg)
    assert out.sequences == ar.sequences and out.stats.batch.forwards <= ar.stats.batch.forwards


@pytest.mark.parametrize("strategy", ["autoregressive", "speculative"])
def test_the_response_read_from_the_ids_committed_in_order_is_the_sorted_context_s(strategy):
    """AR decoding and the exact mode hand their committed ids over in order, and the stream reads the response from
    them: after every round it equals the response read from the context sorted by position, cut after the first EOS
    (mid-answer) and at max_new_tokens."""
    from refusion.decode.loop import Decoder

    model = tiny_model("qwen3")
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3, 4, 3]]
    plain = refusion.generate(model, prompts, max_new_tokens=20, strategy="autoregressive", eos_token_id=[]).sequences
    eos = plain[0][7]  # a token the first answer writes mid-way
    drafting = {} if strategy == "autoregressive" else {"lookup_length": 6, "draft_length": 0}
    cfg = refusion.DecodeConfig(strategy=strategy, max_new_tokens=20, eos_token_id=eos, **drafting)
    checked = []

    def compare(seq, _round):
        assert seq._listed is not None
        assert seq.contiguous_response() == seq._sorted_contiguous_response()
        checked.append(seq.id)

    decoder = Decoder(model)
    seqs = [decoder.add(p, cfg, mask_token_id=TINY_MASK_ID, eos_token_ids=[eos], on_round=compare) for p in prompts]
    decoder.run()
    first = seqs[0].response()
    assert first == plain[0][: plain[0].index(eos) + 1]
    assert len(checked) > 10
    for seq in seqs:
        assert seq.response() == seq._sorted_contiguous_response()
        seq._listed = None  # the sorted context's response: the same
        assert seq.response() == seq._sorted_contiguous_response() == seq.contiguous_response()
