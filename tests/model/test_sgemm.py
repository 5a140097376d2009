"""`model.kernels.sgemm`: fp32 products by MKL's packed weights give F.linear's bits at every row count, in the Python
layers and in the C++ ones, and decoding with them gives the tokens of plain products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import refusion
from refusion.model.compact import CompactForward, compact_forward
from refusion.model.kernels import sgemm
from refusion.model.kernels.sgemm import EXACT, INEXACT, NOT_PROBED, SgemmLinear, use_sgemm_linears
from refusion.model.setup import setup_of
from refusion.model.tiny import tiny_model

from .test_compact import new_cache

pytestmark = pytest.mark.skipif(not sgemm.sgemm_available(), reason="this torch has no MKL-packed fp32 products")


def switched_layer(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    model = nn.Sequential(layer)
    assert use_sgemm_linears(model, force=True) == 1 and type(layer) is SgemmLinear
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 96)])
@torch.inference_mode()
def test_every_row_count_gives_f_linears_bits_first_and_later(shape, bias):
    layer = switched_layer(*shape, bias, seed=1)
    x = torch.randn(2, 70, shape[0])
    for _ in range(2):  # first: probed; then: as recorded
        for rows in (1, 3, 15, 16, 17, 32, 40, 56, 57, 64, 70, 140):
            flat = x.reshape(-1, shape[0])[:rows]
            assert torch.equal(layer(flat), F.linear(flat, layer.weight, layer.bias))
    threads = torch.get_num_threads()
    assert int(layer.exact[threads, 16]) != NOT_PROBED and int(layer.exact[threads, 200]) == NOT_PROBED  # 140 = 2 x 70


@torch.inference_mode()
def test_layers_of_one_shape_share_what_was_probed_and_the_packed_path_runs(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64))
    use_sgemm_linears(model, force=True)
    first, second, other = model
    assert first.exact is second.exact and first.exact is not other.exact
    first(torch.randn(24, 64))
    state = int(second.exact[torch.get_num_threads(), 24])
    assert state in (EXACT, INEXACT)
    calls, linear = [], F.linear
    x = torch.randn(24, 64)
    expected = linear(x, second.weight, second.bias)
    monkeypatch.setattr(sgemm.F, "linear", lambda *a: calls.append(a) or linear(*a))
    assert torch.equal(second(x), expected)
    assert len(calls) == (0 if state == EXACT else 1)  # probed by the first layer: one product, not two


@torch.inference_mode()
def test_each_thread_count_has_its_own_record():
    layer = switched_layer(576, 576, bias=False, seed=4)
    threads = torch.get_num_threads()
    x = torch.randn(8, 576)
    try:
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            assert torch.equal(layer(x), F.linear(x, layer.weight))
            assert int(layer.exact[count, 8]) in (EXACT, INEXACT)
        torch.set_num_threads(layer.exact.shape[0])  # more threads than the record has rows: F.linear
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    finally:
        torch.set_num_threads(threads)


def test_training_the_state_dict_and_written_weights_see_the_plain_weight():
    layer = switched_layer(64, 96, bias=True, seed=2)
    x = torch.randn(32, 64, requires_grad=True)
    layer(x).sum().backward()  # autograd: F.linear
    assert layer.weight.grad is not None and x.grad is not None
    assert set(layer.state_dict()) == {"weight", "bias"}
    with torch.no_grad():
        for _ in range(2):  # probed and packed
            layer(x.detach())
        layer.weight.mul_(-2.0)  # written in place: the packed copy is rebuilt
        y = torch.randn(32, 64)
        assert torch.equal(layer(y), F.linear(y, layer.weight, layer.bias))


def long_forward(model, run, rows: int = 40, seed: int = 0) -> torch.Tensor:
    """Logits of one forward of `rows` new tokens (wide enough for the packed products) through `run`."""
    cache = new_cache(model, None)
    cache.add_sequence(0)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (1, rows), generator=generator)
    positions = torch.arange(rows)[None]
    mask = cache.begin_forward(torch.zeros(1, rows, dtype=torch.long), positions)
    with torch.inference_mode():
        out = run(ids, positions, mask, cache, rows)
    cache.end_forward()
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v with a bias
def test_native_and_python_layers_with_packed_products_keep_the_plain_logits(family):
    def model():
        return tiny_model(family, hidden_size=64, dtype=torch.float32, seed=3, attn_implementation="sdpa")

    plain, switched = model(), model()
    assert use_sgemm_linears(switched, force=True) > 0
    native = compact_forward(switched)
    assert native.native is not None
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, threads}):  # MKL's kernels depend on the thread count: so does the record
            torch.set_num_threads(count)
            for _ in range(2):  # probed, then recorded
                for rows in (5, 20, 40):
                    expected = long_forward(plain, CompactForward(plain, native=False), rows)
                    assert torch.equal(long_forward(switched, CompactForward(switched, native=False), rows), expected)
                    assert torch.equal(long_forward(switched, native, rows), expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("strategy", ["refusion", "speculative"])
def test_a_pinned_sgemm_model_decodes_the_plain_models_tokens(tiny_model_dir, strategy):
    model, _ = refusion.load(tiny_model_dir, dtype="float32", device="cpu", linear="sgemm")
    assert setup_of(model).kernels.linear == "sgemm" and "linear sgemm" in setup_of(model).describe()
    plain, _ = refusion.load(tiny_model_dir, dtype="float32", device="cpu", linear="plain")
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (30, 18)]  # prefill >= 16 rows
    slots = dict(slot_size=4, block_size=16, slot_threshold=0.5, token_threshold=0.3) if strategy == "refusion" else {}
    cfg = refusion.DecodeConfig(strategy=strategy, max_new_tokens=32, eos_token_id=[2], **slots)
    assert refusion.generate(model, prompts, cfg).sequences == refusion.generate(plain, prompts, cfg).sequences


def test_sgemm_is_one_line_where_it_cannot_hold(tiny_model_dir):
    with pytest.raises(ValueError, match="linear='sgemm' needs fp32 weights"):
        refusion.load(tiny_model_dir, dtype="bfloat16", device="cpu", linear="sgemm")


def test_the_switch_follows_force_and_the_probe_and_leaves_the_random_state_alone(monkeypatch):
    assert use_sgemm_linears(tiny_model(dtype=torch.float32), force=False) == 0
    assert use_sgemm_linears(tiny_model(dtype=torch.bfloat16), force=True) == 0  # fp32 weights only
    monkeypatch.setattr(sgemm, "packed_speedup", lambda layers: 1.0)
    assert use_sgemm_linears(tiny_model(dtype=torch.float32)) == 0  # measured no faster
    monkeypatch.undo()
    layers = [nn.Linear(64, 96), nn.Linear(96, 64)]
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert sgemm.packed_speedup(layers) > 0
    assert torch.equal(torch.rand(3), expected)
