"""`model.kernels.fused`: q/k/v and gate/up as one product each, every member's own bits, following its weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refusion.model.compact import CompactForward, compact_forward
from refusion.model.kernels import fused, int4, narrow, row_exact
from refusion.model.kernels.extension import native_available
from refusion.model.kernels.gated_lora import MaskGatedLoRA, MaskRows
from refusion.model.tiny import TINY_MASK_ID, tiny_model

from .test_compact import forwards, transformers_run

KINDS = [pytest.param("packed", marks=pytest.mark.skipif(not row_exact.packing_available(),
                                                         reason="no bf16 packing on this CPU")),
         pytest.param("int4", marks=pytest.mark.skipif(not int4.int4_available(), reason="no int4 CPU kernel")),
         pytest.param("int4-fp32", marks=pytest.mark.skipif(not native_available(), reason="no C++ extension")),
         pytest.param("int4-q8", marks=pytest.mark.skipif(not native_available(), reason="no C++ extension")),
         "narrow"]
"""int4: bf16 rows by torch's kernel; int4-fp32: fp32 rows by refusion's (`csrc/block_products.cpp`); int4-q8: fp32
rows rounded to 8-bit blocks there (`int4.Int4Q8Linear`)."""


HIDDEN = 128
"""k and v then have 64 output features: whole blocks of the int4 packing (members of fewer rows do not fuse)."""


NARROW_PADDING = (0, 2, 2, 4, 4)
"""Row padding of the narrow kind's products in these tests (one row computed as two, three as four)."""
NARROW_PACKED_FROM = 3
"""The narrow kind's products of this many rows or more multiply by oneDNN-packed copies of the weights."""


def model_with(kind: str, family: str = "llama", seed: int = 0):
    """A tiny bf16 model whose linear layers use `kind` (int4: random 4-bit blocks, the weights set to them; int4-fp32
    and int4-q8 the same in an fp32 model), or for "narrow" a tiny fp32 model multiplying weight-major, its products padded (`NARROW_PADDING`), and by packed
    copies from NARROW_PACKED_FROM rows on."""
    if kind == "narrow":
        model = tiny_model(family, hidden_size=HIDDEN, heads=4, kv_heads=2, dtype=torch.float32, seed=seed,
                           attn_implementation="sdpa")
        narrow.use_narrow_linears(model, force=True, padded_rows=NARROW_PADDING, packed_from=NARROW_PACKED_FROM)
        return model
    dtype = torch.float32 if kind in ("int4-fp32", "int4-q8") else torch.bfloat16
    model = tiny_model(family, hidden_size=HIDDEN, heads=4, kv_heads=2, dtype=dtype, seed=seed,
                       attn_implementation=row_exact.EXACT_ATTENTION)
    if kind == "packed":
        row_exact.use_packed_linears(model)
        return model
    generator = torch.Generator().manual_seed(seed)
    for name, layer in model.named_modules():
        head = name == "lm_head"  # fp32: 8-bit blocks (a GGUF's Q8_0 head), so that every product is row-exact
        if type(layer) is nn.Linear and (not head or dtype == torch.float32):
            n, k = layer.weight.shape
            low, high = (-128, 128) if head else (0, 16)
            blocks = int4.Int4Blocks(torch.randint(low, high, (n, k), generator=generator, dtype=torch.int32),
                                     (torch.rand(n, k // int4.GROUP, generator=generator) / 50).half().float(),
                                     (torch.randn(n, k // int4.GROUP, generator=generator) / 10).half().float(),
                                     8 if head else 4)
            with torch.no_grad():
                layer.weight.copy_(blocks.dequantize())
            int4.switch_to_int4(layer, *int4.pack(blocks, dtype),
                                int4.Int4Q8Linear if kind == "int4-q8" else int4.Int4Linear)
    return model


def gate_adapters(model, rank: int = 4) -> MaskRows:
    """Wrap q/k/v and gate/up of every layer in a random mask-gated update (what a shipped adapter does)."""
    mask_rows = MaskRows(model, TINY_MASK_ID)
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        for block_name, names in fused.FUSED_GROUPS.items():
            block = getattr(layer, block_name)
            for name in names:
                base = getattr(block, name)
                a = torch.randn(rank, base.in_features, generator=generator)
                b = torch.randn(base.out_features, rank, generator=generator)
                setattr(block, name, MaskGatedLoRA(base, a, b, 0.5, mask_rows))
    return mask_rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_one_product_gives_every_member_its_own_bits(kind, bias):
    model = model_with(kind, "qwen2" if bias else "llama")  # Qwen2: q/k/v with a bias
    products = fused.fused_products(model.model.layers[0])
    assert set(products) == {"self_attn", "mlp"}
    attention = model.model.layers[0].self_attn
    for rows in (1, 3, 40):  # 40: past the packed kernel's exact chunk and the narrow products' rows
        x = torch.randn(1, rows, HIDDEN).to(model.dtype)
        members = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
        for own, together in zip(members, products["self_attn"](x), strict=True):
            assert torch.equal(own, together)


@pytest.mark.parametrize("kind", KINDS)
def test_the_compact_forward_fuses_and_keeps_transformers_logits_with_mask_gated_updates(kind):
    model = model_with(kind, seed=1)
    gate_adapters(model)
    compact = compact_forward(model)
    assert all(set(layer) == {"self_attn", "mlp"} for layer in compact.fused)
    for ours, theirs in zip(forwards(model, compact), forwards(model, transformers_run(model)), strict=True):
        assert torch.equal(ours, theirs)  # forwards() holds mask tokens: the updates land in the right columns


@pytest.mark.parametrize("kind", KINDS)
def test_a_fused_product_follows_its_members_weights(kind):
    model = model_with(kind, seed=2)
    compact = compact_forward(model)
    forwards(model, compact)  # the fused weights are built
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q_proj.weight.mul_(-1)  # written in place: a new version of the same tensor
    if kind.startswith("int4"):  # the 4-bit blocks no longer describe it: refused, as a lone Int4Linear refuses
        with pytest.raises(RuntimeError, match="load the model again"):
            forwards(model, compact)
        return
    for ours, theirs in zip(forwards(model, compact), forwards(model, transformers_run(model)), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fused_product_follows_its_members_biases(kind):
    model = model_with(kind, "qwen2", seed=6)  # q/k/v with biases, stacked into one copy
    compact = CompactForward(model, native=False)
    forwards(model, compact)  # the fused weights are built
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias.add_(1.0)  # written in place
    for ours, theirs in zip(forwards(model, compact), forwards(model, transformers_run(model)), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_built_forward_is_reused_until_a_member_is_replaced(kind):
    model = model_with(kind, seed=3)
    built = compact_forward(model)
    assert compact_forward(model, built) is built
    attention = model.model.layers[1].self_attn
    attention.v_proj = nn.Linear(HIDDEN, 64, bias=False, dtype=model.dtype)  # e.g. an adapter wrapped it later
    fresh = compact_forward(model, built)
    assert isinstance(fresh, CompactForward) and fresh is not built
    assert "self_attn" not in fresh.fused[1]  # a plain layer beside the others: different kernels
    for ours, theirs in zip(forwards(model, fresh), forwards(model, transformers_run(model)), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_members_stay_apart_where_one_product_would_round_differently(kind, monkeypatch):
    model = model_with(kind, seed=4)
    monkeypatch.setattr(fused, "fusion_is_exact", lambda *args: False)
    assert fused.fused_products(model.model.layers[0]) == {}
    assert fused.fuse("mlp", [nn.Linear(HIDDEN, 256), nn.Linear(HIDDEN, 256)]) is None  # fp32 plain layers: no fused kernel


def test_prepare_builds_the_forward_every_decoder_reuses(tiny_model_dir):
    import refusion
    from refusion.decode.loop import Decoder
    from refusion.model.setup import setup_of

    model, tokenizer = refusion.load(tiny_model_dir, dtype="bfloat16", device="cpu")
    setup = setup_of(model)
    assert isinstance(setup.compact_forward, CompactForward)
    assert Decoder(model).compact is setup.compact_forward


@torch.no_grad()
def test_fused_narrow_members_read_one_stacked_weight_and_still_save(tmp_path):
    """Weight-major fp32 members stacked without a second copy: each member's weight is its rows of the fused
    weight, a member written in place is what the fused product multiplies, and the model saves and loads back
    as it stands."""
    from transformers import AutoModelForCausalLM

    model = model_with("narrow", seed=8)
    compact = CompactForward(model, native=False)
    forwards(model, compact)  # the fused weights are built
    attention = model.model.layers[0].self_attn
    product = compact.fused[0]["self_attn"]
    stacked = product.weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == stacked for m in (attention.q_proj, attention.k_proj,
                                                                            attention.v_proj))
    again = CompactForward(model, native=False)  # e.g. a decoder of a model refusion did not prepare
    forwards(model, again)
    assert again.fused[0]["self_attn"].weight.data_ptr() == product.weight.data_ptr()  # stacked once, not again
    attention.k_proj.weight.add_(0.5)  # written in place through a member
    x = torch.randn(2, HIDDEN)
    assert torch.equal(product(x)[1], attention.k_proj(x))
    for ours, theirs in zip(forwards(model, compact), forwards(model, transformers_run(model)), strict=True):
        assert torch.equal(ours, theirs)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    saved = loaded.state_dict()
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())


def test_fusion_exactness_is_probed_once_per_machine_and_a_record_that_no_longer_holds_is_probed_again(
        monkeypatch, tmp_path):
    from refusion.model.calibration import CalibrationWarning

    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path))
    machine, probes = {"exact": True}, []  # what the kernels do here: the probe's answer at every row count

    def probe(*args, rows=None):
        probes.append(rows)
        return machine["exact"]

    monkeypatch.setattr(fused, "probe_fusion", probe)
    shape = ("narrow", HIDDEN, (64, 32, 32), False, torch.float32, False)

    def new_process() -> bool:
        fused.fusion_is_exact.cache_clear()
        return fused.fusion_is_exact(*shape)

    try:
        assert new_process() and probes == [None]  # measured
        assert new_process() and probes == [None, (1,)]  # read back, checked at one row count
        machine["exact"] = False  # e.g. another torch build's kernels under the same record
        with pytest.warns(CalibrationWarning, match="does not hold"):
            assert not new_process()
        assert probes == [None, (1,), (1,), None]  # the check failed: measured again
        assert not new_process() and probes == [None, (1,), (1,), None]  # "not exact" needs no check
    finally:
        fused.fusion_is_exact.cache_clear()
