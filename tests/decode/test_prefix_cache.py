"""Prefix caching (`decode/prefix_cache.py`): the store's blocks, lookups and eviction; and the decoder's answers with
a reused prefix against fresh ones, in every strategy (bit for bit where forwards are row-exact)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import refusion
from refusion.decode.loop import Decoder
from refusion.decode.prefix_cache import PrefixCache, inexact_reason, narrowed, prefix_cache_for
from refusion.model.kernels.row_exact import EXACT_ATTENTION, EXACT_HALF_ATTENTION
from refusion.model.setup import setup_of
from refusion.model.tiny import TINY_MASK_ID, tiny_model

B = 4  # tokens per block in the store's unit tests
NS = ("model", "float32", "None")  # a namespace (any hashable works for the store)
STRATEGIES = ["refusion", "speculative", "autoregressive"]


def entries(positions: range, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fake entries [kv_heads=1, n, head_dim=2] whose key is the position (value: minus it)."""
    keys = [torch.tensor([[[float(p), float(layer)] for p in positions]]) for layer in range(layers)]
    return keys, [-k for k in keys]


def stored(cache: PrefixCache, prompt: list[int]) -> None:
    """Store a prompt's new whole blocks as the decoder does."""
    start, stop = cache.unstored(NS, prompt)
    if start < stop:
        cache.store(NS, prompt, start, *entries(range(start, stop)))


def block_bytes(layers: int = 2) -> int:
    keys, values = entries(range(B), layers)
    return sum(t.numel() * t.element_size() for t in keys + values)


# ------------------------------------------------------------------------------------------- the store
def test_lookup_finds_whole_blocks_and_leaves_the_last_token():
    cache = PrefixCache(10**6, block_tokens=B)
    prompt = list(range(10, 20))  # 10 tokens: blocks [0, 4) and [4, 8) are whole
    assert cache.lookup(NS, prompt).length == 0
    assert cache.unstored(NS, prompt) == (0, 8)
    stored(cache, prompt)
    assert cache.unstored(NS, prompt) == (8, 8) and cache.tokens == 8
    hit = cache.lookup(NS, prompt + [1, 2])
    assert hit.length == 8 and hit.keys[1][0, :, 0].tolist() == list(range(8)) and torch.equal(hit.values[0],
                                                                                                -hit.keys[0])
    assert cache.lookup(NS, prompt[:8]).length == 4  # the whole prompt cached: its last token is prefilled
    assert cache.lookup(NS, prompt[:5]).length == 4
    assert cache.lookup(NS, [99] + prompt[1:]).length == 0  # a prefix, not any run of tokens
    assert cache.lookup(NS, prompt[:4] + [99] * 6).length == 4
    assert cache.lookup(("other model", "float32", "None"), prompt).length == 0


def test_a_chain_extends_and_blocks_stored_meanwhile_are_kept():
    cache = PrefixCache(10**6, block_tokens=B)
    stored(cache, list(range(8)))
    longer = list(range(16))
    assert cache.unstored(NS, longer) == (8, 16)
    before = cache.blocks.copy()
    stored(cache, longer)
    assert cache.tokens == 16 and all(cache.blocks[k] is b for k, b in before.items())
    cache.store(NS, longer, 0, *entries(range(0, 16)))  # a second sequence that prefilled the same prompt
    assert cache.tokens == 16 and all(cache.blocks[k] is b for k, b in before.items())
    with pytest.raises(ValueError, match="whole"):
        cache.store(NS, longer, 2, *entries(range(2, 6)))


def test_eviction_keeps_the_budget_and_takes_leaves_first():
    cache = PrefixCache(5 * block_bytes(), block_tokens=B)
    system = [7] * 8
    for turn in range(6):  # conversations sharing a system prompt, each growing
        for talk in (1, 2):
            stored(cache, system + [talk] * (4 * turn + 4))
            assert cache.nbytes <= cache.budget_bytes
            ids = {b.id for b in cache.blocks.values()} | set(cache._roots.values())
            assert all(key[0] in ids for key in cache.blocks), "a block outlived its parent"
    assert len(cache.blocks) == 5
    assert cache.lookup(NS, system + [3]).length == 8  # the shared blocks were used last: still there
    assert cache.lookup(NS, system + [2] * 24 + [0]).length > 8  # the latest conversation's chain


def test_a_chain_larger_than_the_budget_keeps_its_first_blocks():
    cache = PrefixCache(2 * block_bytes(), block_tokens=B)
    prompt = list(range(20))
    stored(cache, prompt)
    assert cache.tokens == 8 and cache.lookup(NS, prompt).length == 8


def test_entries_are_stored_narrow_where_that_keeps_every_value():
    exact = [torch.tensor([1.5, -2.0], dtype=torch.float64)]
    assert narrowed(exact, torch.bfloat16)[0].dtype == torch.bfloat16
    fine = [torch.tensor([1 / 3], dtype=torch.float64)]
    assert narrowed(fine, torch.bfloat16) is fine


# ------------------------------------------------------------------------------------------- the decoder
class RowByRowLinear(nn.Linear):
    """A linear layer multiplying each row alone: row-exact by construction on any CPU (the tests' stand-in for
    the packed bf16 kernels of AMX and AVX512-BF16 CPUs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = [F.linear(flat[i:i + 1], self.weight, self.bias) for i in range(flat.shape[0])]
        return torch.cat(rows).view(*x.shape[:-1], -1)


def row_by_row(dtype: torch.dtype, attention: str):
    """(a tiny model with `attention` and row-by-row products, its setup promising row-exact forwards)."""
    model = tiny_model("qwen3", dtype=dtype, seed=2, attn_implementation=attention)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowByRowLinear
    return model, setup_of(model).replace(row_exact=True)


@pytest.fixture(scope="module")
def row_exact_model():
    """(bf16 model with exact attention and row-by-row products, its setup promising row-exact forwards)."""
    return row_by_row(torch.bfloat16, EXACT_ATTENTION)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three prompts sharing a 40-token system prompt."""
    rng = random.Random(0)
    system = [rng.randint(3, 60) for _ in range(40)]
    return [system + [rng.randint(3, 60) for _ in range(rng.randint(1, 12))] for _ in range(3)]


def config(strategy: str) -> refusion.DecodeConfig:
    return refusion.DecodeConfig(max_new_tokens=16, slot_size=4, block_size=8, eos_token_id=[2],
                                 logprobs=0).for_strategy(strategy)


def decode(model, prompts, cfg, prefix_cache=None, setup=None) -> tuple[list[list[int]], list, list[int | None]]:
    """(answers, their logprobs, cached prompt tokens) of one batch."""
    decoder = Decoder(model, setup=setup, prefix_cache=prefix_cache)
    seqs = [decoder.add(p, cfg, mask_token_id=TINY_MASK_ID, eos_token_ids=[2]) for p in prompts]
    decoder.run()
    assert not decoder.cache.row_of
    return ([s.response() for s in seqs], [[lp.logprob for lp in s.response_logprobs()] for s in seqs],
            [s.stats.cached_tokens for s in seqs])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_entries_are_stored_as_they_are_and_reused_bit_for_bit(strategy, prompts):
    """Exact attention over fp16 entries (an fp32 model): its prefixes are stored as fp16, not widened to the
    model's fp32, and answers and logprobs with a reused prefix are the fresh ones, bit for bit."""
    model, setup = row_by_row(torch.float32, EXACT_HALF_ATTENTION)
    cfg = config(strategy)
    fresh = [decode(model, [p], cfg, setup=setup) for p in prompts]
    cache = PrefixCache(10**8)
    decode(model, prompts[:1], cfg, cache, setup)
    assert {b.keys[0].dtype for b in cache.blocks.values()} == {torch.float16}
    answers, logprobs, cached = decode(model, prompts[1:], cfg, cache, setup)
    assert cached == [32, 32]
    assert answers == [f[0][0] for f in fresh[1:]] and logprobs == [f[1][0] for f in fresh[1:]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reused_prefixes_give_the_fresh_answers(strategy, prompts):
    """fp32 (not row-exact): the same tokens, one prompt at a time and in a batch beside other sequences."""
    model, cfg = tiny_model("qwen3", dtype=torch.float32, seed=2), config(strategy)
    fresh = [decode(model, [p], cfg)[0][0] for p in prompts]
    cache = PrefixCache(10**8)
    answers, _, cached = decode(model, prompts[:1], cfg, cache)
    assert answers == fresh[:1] and cached == [0]
    answers, _, cached = decode(model, prompts[1:], cfg, cache)
    assert answers == fresh[1:] and cached == [32, 32]  # the system prompt's two whole blocks
    assert len({tuple(a) for a in fresh}) > 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reused_prefixes_give_the_fresh_answers_bit_for_bit_where_rows_are_exact(strategy, prompts,
                                                                                  row_exact_model):
    model, setup = row_exact_model
    cfg = config(strategy)
    fresh = [decode(model, [p], cfg, setup=setup) for p in prompts]
    cache = PrefixCache(10**8)
    decode(model, prompts[:1], cfg, cache, setup)
    assert {b.keys[0].dtype for b in cache.blocks.values()} == {torch.bfloat16}  # fp64 entries kept as bf16
    answers, logprobs, cached = decode(model, prompts[1:], cfg, cache, setup)
    assert cached == [32, 32]
    assert answers == [f[0][0] for f in fresh[1:]] and logprobs == [f[1][0] for f in fresh[1:]]
    decoder = Decoder(model, setup=setup, prefix_cache=cache)  # a hit joining a batch that is decoding
    first = decoder.add(prompts[1], cfg, mask_token_id=TINY_MASK_ID, eos_token_ids=[2])
    for _ in range(3):
        decoder.step()
    joining = decoder.add(prompts[2], cfg, mask_token_id=TINY_MASK_ID, eos_token_ids=[2])
    decoder.run()
    assert first.stats.cached_tokens >= 32 and joining.stats.cached_tokens >= 32
    for seq, (answer, logprob, _) in ((first, fresh[1]), (joining, fresh[2])):
        assert seq.response() == answer[0] and [lp.logprob for lp in seq.response_logprobs()] == logprob[0]


@pytest.mark.parametrize("exact", [True, False], ids=["row-exact", "fp32"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_chat_turn_reuses_the_conversation_it_resends(strategy, exact, row_exact_model):
    """Each turn finds the last turn's prompt, and its answer where kept; the answers are the fresh ones (their
    logprobs too, bit for bit, where rows are exact; in fp32 the same tokens)."""
    model, setup = row_exact_model if exact else (tiny_model("qwen3", dtype=torch.float32, seed=2), None)
    cfg = config(strategy) if exact else config(strategy).replace(logprobs=None)
    cache = PrefixCache(10**8)
    conversation, previous = [5, 9, 11, 4, 7, 30, 31, 32] * 3, 0  # previous: the last turn's entries kept
    for turn in range(3):
        answer, logprobs, cached = decode(model, [conversation], cfg, cache, setup)
        fresh = decode(model, [conversation], cfg, setup=setup)
        assert (answer, logprobs) == fresh[:2]
        assert cached[0] == previous // 16 * 16  # every whole block the last turn kept
        # its prompt's entries, and where they are a prefill's, its answer's (but the last token's: never computed)
        previous = len(conversation) + (len(answer[0]) - 1 if strategy != "refusion" else 0)
        conversation = conversation + answer[0] + [3, 12 + turn, 2]


def test_prefix_caching_is_refused_where_a_split_prefill_could_change_answers():
    bf16 = tiny_model("qwen3", dtype=torch.bfloat16)
    assert "bfloat16" in inexact_reason(bf16, setup_of(bf16))
    with pytest.raises(ValueError, match="prefix caching is off"):
        Decoder(bf16, prefix_cache=PrefixCache(10**6))
    assert prefix_cache_for(bf16, setup_of(bf16), 64)[0] is None
    fp32 = tiny_model("qwen3")
    assert prefix_cache_for(fp32, setup_of(fp32), 0) == (None, "prefix cache off (0 MiB)")
    cache, line = prefix_cache_for(fp32, setup_of(fp32), 64)
    assert cache.budget_bytes == 64 * 2**20 and "64 MiB" in line
    compiled = setup_of(fp32).replace(compiled=fp32)
    assert "compiled" in inexact_reason(fp32, compiled)


def test_two_models_share_a_store_without_mixing_their_prefixes(prompts):
    one, two = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)
    cfg, cache = config("autoregressive"), PrefixCache(10**8)
    decode(one, prompts[:1], cfg, cache)
    assert decode(two, prompts[1:2], cfg, cache)[2] == [0]
    assert decode(one, prompts[1:2], cfg, cache)[2] == [32]
