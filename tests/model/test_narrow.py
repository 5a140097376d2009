"""Weight-major linear layers for narrow CPU forwards: the same function, the same weights, the same decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import refusion
from refusion.model.kernels import narrow
from refusion.model.kernels.narrow import NarrowLinear, plain_linears, use_narrow_linears
from refusion.model.tiny import tiny_model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (1, 5), (3, narrow.MAX_ROWS), (2, narrow.MAX_ROWS)])
def test_narrow_linear_computes_the_linear_map_at_every_width(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape, 24)
    expected = layer(x)
    layer.__class__ = NarrowLinear
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7])
def test_padded_narrow_products_compute_the_linear_map(rows):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(1, rows, 24)
    expected = layer(x)
    layer.__class__ = NarrowLinear
    layer.padded_rows = (0, 2, 2, 4, 4, 6, 6, 8, 8)  # every odd count computed with one zero row more
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_products_from_packed_from_rows_on_take_the_packed_copy_and_follow_the_weight(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    layer.__class__ = NarrowLinear
    layer.padded_rows, layer.packed_from = (0, 2, 2), 3
    calls = []
    product = narrow.packed_product
    monkeypatch.setattr(narrow, "packed_product", lambda *args: calls.append(args[0].shape[0]) or product(*args))
    for rows in (1, 2, 3, 5, narrow.MAX_ROWS + 8):  # wider than weight-major products: a prefill
        x = torch.randn(1, rows, 24)
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [3, 5, narrow.MAX_ROWS + 8]  # one and two rows stay weight-major
    layer.weight.mul_(-1)  # written in place: packed again
    x = torch.randn(4, 24)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # training takes the differentiable products
        x.requires_grad_(True)
        layer(x).sum().backward()
    assert x.grad is not None and calls[-1] == 4


def test_packed_copies_from_the_fewest_rows_where_they_win_and_never_lose_after():
    # ms through every layer at 1-8, 16 and 32 rows, shaped like a 2-core AVX-512 EPYC's (E4)
    major = [14.6, 14.6, 22.2, 23.0, 27.6, 32.7, 38.7, 37.0, 48.1, 68.5]
    packed = [18.6, 20.7, 16.0, 15.2, 16.5, 17.0, 18.0, 19.1, 24.8, 40.7]
    assert narrow.packed_from_times(major, packed) == 3
    assert narrow.packed_from_times(major, packed[:3] + [22.0] + packed[4:]) == 3  # 4 rows: within the gain, not slower
    assert narrow.packed_from_times(major, packed[:3] + [24.0] + packed[4:]) == 5  # 4 rows slower: from 5
    assert narrow.packed_from_times(major, packed[:-1] + [70.0]) == 0  # losing at 32 rows: never
    assert narrow.packed_from_times(major, packed, min_gain=3.0) == 0
    # E5 (2-core AVX2 EPYC, fp32): the forms tie at 16 and 32 rows, packed wins from 5
    major = [32.4, 32.4, 31.5, 41.1, 47.0, 53.2, 58.5, 53.3, 62.6, 87.0]
    packed = [33.1, 34.4, 33.9, 38.9, 40.8, 34.4, 38.9, 41.1, 61.6, 81.2]
    assert narrow.packed_from_times(major, packed) == 5


def test_row_padding_picks_the_fastest_count_within_twice_the_rows():
    # times of 1..8 rows (ms) shaped like a 2-core AVX2 CPU's: odd counts up to 4 cost more than one row more
    times = [30.9, 22.0, 27.8, 22.3, 28.9, 35.6, 42.7, 37.5]
    assert narrow.row_padding(times) == (0, 2, 2, 4, 4, 5, 6, 8, 8)
    assert narrow.row_padding(times, min_gain=1.5) == (0, 1, 2, 3, 4, 5, 6, 7, 8)  # no gain that large
    assert narrow.row_padding([1.0] * 4) == (0, 1, 2, 3, 4)  # flat: nothing padded


def test_narrow_linear_keeps_autograd_and_the_state_dict():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.__class__ = NarrowLinear
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(6, 1) * x.detach().sum(0)[None])
    assert layer.state_dict().keys() == before.keys()
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())
    assert isinstance(layer, nn.Linear)  # peft and friends still see a linear layer


def test_use_narrow_linears_switches_every_plain_linear_and_only_when_told_or_faster(monkeypatch):
    model = tiny_model()
    count = len(plain_linears(model))
    assert count > 0
    assert use_narrow_linears(model, force=False) == 0
    monkeypatch.setattr(narrow, "PROBE_BYTES", 0)  # as if the tiny weights streamed from memory
    monkeypatch.setattr(narrow, "weight_major_speedup", lambda layers: 1.0)  # the probe finds no gain
    assert use_narrow_linears(model) == 0
    assert not any(isinstance(m, NarrowLinear) for m in model.modules())
    monkeypatch.setattr(narrow, "weight_major_speedup", lambda layers: 2.0)  # the probe finds weight-major faster
    monkeypatch.setattr(narrow, "weight_major_row_times", lambda layers: [3.0, 2.0, 3.0, 2.0])
    assert use_narrow_linears(model) == count
    assert sum(isinstance(m, NarrowLinear) for m in model.modules()) == count
    assert plain_linears(model) == []
    assert {m.padded_rows for m in model.modules() if isinstance(m, NarrowLinear)} == {(0, 2, 2, 4, 4)}


@pytest.mark.parametrize("padded_rows", [None, (0, 2, 2, 4, 4, 6, 6, 8, 8)])
@pytest.mark.parametrize("strategy", ["autoregressive", "speculative", "refusion"])
def test_decoding_with_narrow_linears_gives_the_same_tokens(strategy, padded_rows):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 4]]
    cfg = refusion.DecodeConfig(max_new_tokens=24, strategy=strategy, draft_length=3, slot_size=4, block_size=8,
                                eos_token_id=[])
    plain = refusion.generate(tiny_model(), prompts, cfg)
    for batch in (prompts, prompts[2:]):  # a batch of one decodes with odd row counts (AR: one row a forward)
        model = tiny_model()
        use_narrow_linears(model, force=True, padded_rows=padded_rows)
        expected = plain.sequences if batch is prompts else refusion.generate(tiny_model(), batch, cfg).sequences
        assert refusion.generate(model, batch, cfg).sequences == expected


def test_a_model_that_fits_in_a_cpu_cache_is_left_alone(monkeypatch):
    monkeypatch.setattr(narrow, "weight_major_speedup", lambda layers: 9.0)
    model = tiny_model()
    assert use_narrow_linears(model) == 0  # no probe, no switch: a tiny model is never streamed from memory


def test_the_probe_times_both_forms_and_leaves_the_global_random_state_alone():
    layers = plain_linears(tiny_model())
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    speedup = narrow.weight_major_speedup(layers)
    times = narrow.weight_major_row_times(layers, max_rows=3)
    assert speedup > 0 and len(times) == 3 and min(times) > 0
    assert torch.equal(torch.rand(3), expected)
