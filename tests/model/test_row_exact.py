"""Row-exact bf16 forwards (CPUs with native bf16): packed linears that are F.linear bit for bit with rows
independent of their count, the packed copy following the parameter, attention independent of the other rows and of
the keys' order, and the exact mode equal to AR decoding in bf16 with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import refusion
from refusion.model import loading
from refusion.model.kernels import row_exact
from refusion.model.kernels import row_exact as packed
from refusion.model.kernels.row_exact import PackedLinear, use_packed_linears
from refusion.model.tiny import tiny_model

needs_packing = pytest.mark.skipif(not packed.packing_available(),
                                   reason="this CPU's torch packs no bf16 weights (no AMX, no AVX512-BF16)")


def packed_copy(layer: nn.Linear) -> PackedLinear:
    copy = PackedLinear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)
    copy.load_state_dict(layer.state_dict())
    copy.exact_rows = packed.ExactRows(1, packed.MAX_EXACT_ROWS)
    return copy


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_packed_product_is_f_linear_and_every_row_comes_out_as_alone(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    fast = packed_copy(layer)
    fast.exact_rows = rows = packed.exact_rows(96, 160)
    assert rows.high >= packed.MIN_EXACT_ROWS
    x = torch.randn(1, 90, 96).to(torch.bfloat16)
    alone = torch.cat([fast(x[:, i:i + 1]) for i in range(90)], dim=1)
    if rows.low == 1:
        assert torch.equal(alone[:, :1], layer(x[:, :1]))
    for width in (1, 2, 3, 8, rows.high, rows.high + 1, 90):  # wider than exact_rows: in chunks
        assert torch.equal(fast(x[:, :width]), alone[:, :width]), width
    torch.testing.assert_close(fast(x), layer(x), rtol=1e-2, atol=1e-2)


@needs_packing
def test_the_packed_weight_follows_the_parameter():
    torch.manual_seed(0)
    layer = packed_copy(nn.Linear(64, 64, bias=False, dtype=torch.bfloat16))
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        before = layer(x)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(x).float().square().sum().backward()  # grad enabled: the plain product, with autograd
    optimizer.step()
    with torch.no_grad():
        after = layer(x)
        assert not torch.equal(after, before)
        assert torch.equal(after, nn.functional.linear(x, layer.weight))
        layer.weight.data = torch.randn(64, 64).to(torch.bfloat16)  # replaced, not written in place
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight))


def test_chunked_products_pad_narrow_products_and_split_wide_ones():
    """Every product is computed at low..high rows: one row padded with a zero row, nine rows as 4 + 4 + 1, the
    last chunk padded too; each row comes back where it was."""
    calls = []

    def product(x, weight, bias):
        calls.append(x.shape[0])
        return x @ weight.T

    weight, x = torch.randn(3, 5), torch.randn(9, 5)
    rows = packed.ExactRows(2, 4)
    assert torch.equal(packed.chunked_product(x[:1], weight, None, rows, product), x[:1] @ weight.T)
    assert calls == [2]
    calls.clear()
    assert torch.equal(packed.chunked_product(x, weight, None, rows, product), x @ weight.T)
    assert calls == [4, 4, 2]
    calls.clear()
    packed.chunked_product(x[:3], weight, None, packed.ExactRows(1, 4), product)
    assert calls == [3]


@needs_packing
def test_exact_rows_pads_where_one_row_products_round_their_own_way(monkeypatch):
    """A CPU whose one-row products round some outputs differently from products of 2+ rows (an AVX512-BF16
    EPYC did, for 1536 inputs): the probe sees it and asks for 2 rows at least."""
    plain = packed.packed_product
    one_row_calls = []

    def one_row_rounds_its_own_way(x, weight, bias):
        out = plain(x, weight, bias)
        if x.shape[0] == 1:
            one_row_calls.append(1)
            if len(one_row_calls) % 10 == 3:  # a few rows, one output each
                out = out.clone()
                out[0, 0] = out[0, 0] * 2 + 1
        return out

    monkeypatch.setattr(packed, "packed_product", one_row_rounds_its_own_way)
    rows = packed.probe_exact_rows(96, 160)
    assert rows.low == 2 and rows.high >= packed.MIN_EXACT_ROWS


def test_only_bf16_cpu_models_are_packed():
    assert use_packed_linears(tiny_model("llama", hidden_size=64)) == 0  # fp32
    model = tiny_model("llama", hidden_size=64, dtype=torch.bfloat16)
    switched = use_packed_linears(model)
    assert switched == (15 if packed.packing_available() else 0)  # 2 layers x 7 + lm_head
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is PackedLinear and m.exact_rows.high >= packed.MIN_EXACT_ROWS for m in layers) == bool(switched)


def test_load_picks_dtype_and_attention_that_keep_rows_exact(monkeypatch):
    cpu = torch.device("cpu")
    expected = row_exact.EXACT_ATTENTION if row_exact.packing_available() else "sdpa"
    assert loading.default_attention(cpu, torch.bfloat16) == expected
    assert loading.default_attention(cpu, torch.float32) == "sdpa"
    assert loading.default_attention(cpu, torch.float32, "int4-q8") == row_exact.EXACT_HALF_ATTENTION
    assert loading.default_attention(torch.device("cuda"), torch.bfloat16) == "sdpa"
    monkeypatch.setattr(loading, "packing_available", lambda: False)
    assert loading.default_dtype(cpu) == torch.float32
    monkeypatch.setattr(loading, "packing_available", lambda: True)
    monkeypatch.setattr(loading, "packed_rows_match", lambda: False)  # packed, but not exact row by row
    assert loading.default_dtype(cpu) == torch.float32
    monkeypatch.setattr(loading, "packed_rows_match", lambda: True)
    assert loading.default_dtype(cpu) == torch.bfloat16


def test_the_cpu_dtype_is_decided_without_a_clock(monkeypatch):
    """The same machine loads the same dtype in every process, however busy: nothing timed decides it."""
    import time

    def no_clock():
        raise AssertionError("the dtype choice read a clock")

    monkeypatch.setattr(time, "perf_counter", no_clock)
    row_exact.exact_rows.cache_clear()
    row_exact.packing_available.cache_clear()
    first = loading.default_dtype(torch.device("cpu"))
    assert all(loading.default_dtype(torch.device("cpu")) == first for _ in range(3))


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_exact_mode_is_autoregressive_decoding_with_packed_linears(arch):
    """In bf16 with packed linears and exact attention, a forward of k tokens computes each row as k one-token
    forwards would, so every draft length decodes AR's tokens exactly, and a batch decodes each sequence as
    alone (with plain bf16 products and fused attention neither held: docs/BENCHMARKS.md)."""
    model = tiny_model(arch, hidden_size=128, heads=4, kv_heads=2, dtype=torch.bfloat16,
                       attn_implementation=row_exact.EXACT_ATTENTION)
    assert use_packed_linears(model) > 0
    prompts = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9, 12, 13]]
    ar = refusion.DecodeConfig(max_new_tokens=32, strategy="autoregressive", eos_token_id=2)
    for prompt in prompts:
        expected = refusion.generate(model, [prompt], ar).sequences
        for draft_length in (1, 3, 6):
            cfg = refusion.DecodeConfig(max_new_tokens=32, strategy="speculative", draft_length=draft_length,
                                        eos_token_id=2)
            assert refusion.generate(model, [prompt], cfg).sequences == expected, (prompt, draft_length)
    alone = [refusion.generate(model, [prompt], ar).sequences[0] for prompt in prompts]
    assert refusion.generate(model, prompts, ar).sequences == alone
    cfg = refusion.DecodeConfig(max_new_tokens=32, strategy="speculative", draft_length=2, eos_token_id=2)
    assert refusion.generate(model, prompts, cfg).sequences == alone


class Heads(nn.Module):
    """What attention functions read from their module: 4 query heads over 2 key heads."""

    num_key_value_groups = 2
    training = False


def test_exact_attention_is_eager_attention_computed_exactly():
    """Each query row comes out the same with other rows beside it and with its keys anywhere in the cache (in
    their order, with holes between them), and equals eager attention's result up to its bf16 rounding."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(0)
    query = torch.randn(1, 4, 6, 16).to(torch.bfloat16)
    key, value = (torch.randn(1, 2, 40, 16).to(torch.bfloat16) for _ in range(2))
    mask = torch.zeros(1, 1, 6, 40, dtype=torch.bfloat16)
    mask[..., 37:] = torch.finfo(torch.bfloat16).min  # the last keys: hidden (drafts, padding)
    out, _ = row_exact.exact_attention(Heads(), query, key, value, mask, scaling=0.25)
    reference, _ = eager_attention_forward(Heads(), query.double(), key.double(), value.double(), mask.double(),
                                           scaling=0.25)
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=1e-2)
    columns = torch.randperm(100)[:40].sort().values  # the 40 keys spread over 100 columns, in order
    spread_key, spread_value = (torch.zeros(1, 2, 100, 16, dtype=torch.bfloat16) for _ in range(2))
    spread_key[:, :, columns], spread_value[:, :, columns] = key, value
    spread_mask = torch.full((1, 1, 6, 100), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16)
    spread_mask[..., columns] = mask
    for row in range(6):
        alone, _ = row_exact.exact_attention(Heads(), query[:, :, row:row + 1], key[:, :, :37], value[:, :, :37],
                                             None, scaling=0.25)
        spread, _ = row_exact.exact_attention(Heads(), query[:, :, row:row + 1], spread_key, spread_value,
                                              spread_mask[:, :, row:row + 1], scaling=0.25)
        assert torch.equal(out[:, row:row + 1], alone) and torch.equal(spread, alone), row


def test_exact_attentions_softmax_sums_the_same_wherever_the_keys_sit():
    """A batch's other sequences leave holes between a row's keys (their wider forwards): ATen's softmax sums each
    column in the lane its index gives it, so there it rounds differently (what made the exact mode at batch 4
    leave AR decoding on 4 of 8 requests); `canonical_softmax` moves the seen columns to the front first."""
    generator = torch.Generator().manual_seed(0)
    seen = torch.randn(4, 3, 2, 45, generator=generator, dtype=torch.float64) * 4  # [B, H, T, keys]
    columns = torch.randperm(120, generator=generator)[:45].sort().values
    lowest = torch.finfo(torch.float32).min
    spread = torch.zeros(4, 3, 2, 120, dtype=torch.float64)
    spread[..., columns] = seen
    mask = torch.full((4, 1, 2, 120), lowest)
    mask[..., columns] = 0
    together = row_exact.canonical_softmax(seen, torch.zeros(4, 1, 2, 45))
    apart = row_exact.canonical_softmax(spread + mask, mask)
    assert torch.equal(apart[..., columns], together) and torch.equal(together, row_exact.canonical_softmax(seen, None))
    holes = torch.ones(120, dtype=torch.bool)
    holes[columns] = False
    assert not apart[..., holes].any()
    naive = torch.softmax((spread + mask).float(), dim=-1)[..., columns]  # the rounding the holes change
    assert not torch.equal(naive, torch.softmax(seen.float(), dim=-1))
    short = seen[..., :10]  # a row of fewer columns than a vector's lanes alone, and among many
    among = torch.cat([torch.zeros(4, 1, 2, 10), torch.full((4, 1, 2, 110), lowest)], -1)
    assert torch.equal(row_exact.canonical_softmax(short, None),
                       row_exact.canonical_softmax(torch.cat([short, spread[..., 10:]], -1) + among, among)[..., :10])


def test_exact_attention_gives_the_same_bits_over_fp64_entries():
    """Its decoders keep KV entries in fp64 (`cache_dtype`): the same numbers as converting bf16 ones each time."""
    torch.manual_seed(1)
    query = torch.randn(1, 4, 3, 16).to(torch.bfloat16)
    key, value = (torch.randn(1, 2, 25, 16).to(torch.bfloat16) for _ in range(2))
    mask = torch.zeros(1, 1, 3, 25, dtype=torch.bfloat16)
    mask[..., 20:] = torch.finfo(torch.bfloat16).min
    out, _ = row_exact.exact_attention(Heads(), query, key, value, mask, scaling=0.25)
    wide, _ = row_exact.exact_attention(Heads(), query, key.double(), value.double(), mask, scaling=0.25)
    assert wide.dtype == torch.bfloat16 and torch.equal(out, wide)


def test_exact_half_attention_is_exact_attention_over_fp16_entries_row_by_row():
    """fp32 rows over keys and values rounded to fp16 (what its decoders' caches keep, `cache_dtype`): the same bits
    as exact attention over the rounded entries, from fp32 or fp16 ones, each row as it is alone."""
    torch.manual_seed(2)
    query = torch.randn(1, 4, 5, 16)
    key, value = (torch.randn(1, 2, 30, 16) for _ in range(2))
    mask = torch.zeros(1, 1, 5, 30)
    mask[..., 27:] = torch.finfo(torch.float32).min
    out, _ = row_exact.exact_half_attention(Heads(), query, key, value, mask, scaling=0.25)
    half, _ = row_exact.exact_half_attention(Heads(), query, key.half(), value.half(), mask, scaling=0.25)
    rounded, _ = row_exact.exact_attention(Heads(), query, key.half().float(), value.half().float(), mask,
                                           scaling=0.25)
    assert out.dtype == torch.float32 and torch.equal(out, half) and torch.equal(out, rounded)
    unrounded, _ = row_exact.exact_attention(Heads(), query, key, value, mask, scaling=0.25)
    assert not torch.equal(out, unrounded)  # the rounding is there
    for row in range(5):
        alone, _ = row_exact.exact_half_attention(Heads(), query[:, :, row:row + 1], key[:, :, :27],
                                                  value[:, :, :27], None, scaling=0.25)
        assert torch.equal(out[:, row:row + 1], alone), row


@pytest.mark.parametrize("strategy", ["autoregressive", "speculative", "refusion"])
def test_decoders_keep_fp64_entries_for_exact_attention_and_decode_the_same_tokens(strategy, monkeypatch):
    from refusion.decode import forward, loop

    model = tiny_model("qwen3", hidden_size=64, dtype=torch.bfloat16, attn_implementation=row_exact.EXACT_ATTENTION)
    use_packed_linears(model)
    assert row_exact.cache_dtype(model) == torch.float64
    assert row_exact.cache_dtype(tiny_model("qwen3", dtype=torch.bfloat16, attn_implementation="eager")) is None
    decoder = loop.Decoder(model)
    assert decoder.cache.kv_dtype == torch.float64
    cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="refusion", slot_size=2, block_size=8, draft_length=2,
                                eos_token_id=2).for_strategy(strategy)
    prompts = [[1, 5, 7, 9], [9, 12, 13]]
    wide = refusion.generate(model, prompts, cfg)
    monkeypatch.setattr(forward, "cache_dtype", lambda model: None)  # entries in the dtype the layers write
    assert loop.Decoder(model).cache.kv_dtype is None
    narrow = refusion.generate(model, prompts, cfg)
    assert wide.sequences == narrow.sequences and wide.stats.batch.forwards == narrow.stats.batch.forwards


@needs_packing  # the probe packs real bf16 weights
def test_exact_rows_are_probed_once_per_machine_and_read_back(monkeypatch, tmp_path):
    """The probe compares bits (the same answer every time), so it is recorded like the timed probes: a later
    process reads the record instead of probing."""
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path))
    packed.exact_rows.cache_clear()
    first = packed.exact_rows(96, 160)
    packed.exact_rows.cache_clear()

    def no_probe(*args):
        raise AssertionError("probed again")

    monkeypatch.setattr(packed, "probe_exact_rows", no_probe)
    assert packed.exact_rows(96, 160) == first
    packed.exact_rows.cache_clear()
