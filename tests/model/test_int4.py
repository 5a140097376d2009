"""Weights as shipped (linear kernel "int4"): a GGUF file's blocks read back exactly, in the rows and names
transformers gives them, multiplied row by row (bf16 by torch's kernel, fp32 by refusion's) so that the exact mode
stays AR decoding, and refused with one line where they cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from torch import nn

import refusion
from refusion.model import loading
from refusion.model.kernels import int4, row_exact
from refusion.model.kernels.extension import native_available
from refusion.model.kernels.int4 import GROUP, Int4Blocks, Int4Linear
from refusion.model.setup import prepare, setup_of
from refusion.model.tiny import tiny_model

pytestmark = pytest.mark.skipif(not int4.int4_available(), reason="this torch build has no int4 CPU kernel")


needs_native = pytest.mark.skipif(not native_available(), reason="the C++ extension cannot be built here")


def quantized(weight: torch.Tensor, kind: str = "Q4_1") -> tuple[np.ndarray, Int4Blocks]:
    """(raw GGUF rows, blocks) of a weight quantized as llama.cpp does."""
    raw = quants.quantize(weight.float().numpy(), GGMLQuantizationType[kind])
    q, d, m = int4._unpack_blocks(raw, kind)
    return raw, Int4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), 8 if kind == "Q8_0" else 4)


@torch.no_grad()
def layer_on_blocks(in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.bfloat16,
                    kind: str = "Q4_1", extra_rows: int = 0) -> tuple[nn.Linear, Int4Blocks]:
    """A layer whose weight is exactly what its `kind` blocks hold (then `extra_rows` rows the blocks lack, as an LM
    head grown by added tokens has), and the blocks."""
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features + extra_rows, bias=bias, dtype=dtype)
    _, blocks = quantized(layer.weight[:out_features], kind)
    layer.weight[:out_features] = blocks.dequantize()
    return layer, blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_unpack_to_what_gguf_dequantizes_bit_for_bit(kind):
    torch.manual_seed(0)
    raw, blocks = quantized(torch.randn(48, 4 * GROUP), kind)
    expected = quants.dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(blocks.dequantize().numpy(), expected)  # the plain fp32 load's weights, bit for bit


def assert_rows_as_alone(layer: nn.Module, x: torch.Tensor, widths: tuple[int, ...]) -> None:
    """Each of the first `widths` rows of x (its second-to-last dimension) comes out of `layer` bit for bit as it
    does alone, and all of them alike on one thread as on several."""
    alone = torch.cat([layer(x[..., i:i + 1, :]) for i in range(x.shape[-2])], dim=-2)
    for width in widths:
        assert torch.equal(layer(x[..., :width, :]), alone[..., :width, :]), width
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), alone)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("kind,extra_rows,groups", [("Q4_0", 0, 4), ("Q4_1", 0, 4), ("Q8_0", 0, 4), ("Q8_0", 3, 4),
                                                    ("Q4_1", 11, 4), ("Q4_1", 0, 18), ("Q8_0", 3, 18)])
@torch.no_grad()
def test_fp32_products_are_the_files_weights_and_every_row_comes_out_as_alone(kind, extra_rows, groups, monkeypatch):
    """fp32 rows by refusion's kernel: F.linear's values on the same weights (which are the blocks' exactly), each
    row bit for bit whatever the rows with it and the threads (one row widens no tile into memory); rows the blocks
    lack multiply as they are. Blocks a row: 4, and 18 (the embedded model's 576 features)."""
    layer, blocks = layer_on_blocks(groups * GROUP, 48, bias=True, dtype=torch.float32, kind=kind,
                                    extra_rows=extra_rows)
    reference = nn.Linear(groups * GROUP, 48 + extra_rows, bias=True)
    reference.load_state_dict(layer.state_dict())
    assert int4.can_switch(layer, 48, blocks.bits)
    int4.check_blocks(layer, blocks)
    int4.switch_to_int4(layer, *int4.pack(blocks, torch.float32))
    x = torch.randn(2, 70, groups * GROUP)  # 140 rows: past the kernel's blocks of 64 rows
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x[:1, :1]), reference(x[:1, :1]), rtol=1e-5, atol=1e-5)  # one row alone
    assert_rows_as_alone(layer, x, (1, 2, 3, 5, 8, 33, 70))
    assert set(layer.state_dict()) == {"weight", "bias"}
    with torch.enable_grad():  # training takes the plain weight, with autograd
        assert layer(x[:, :2]).requires_grad


def int8_rows_reference(x: torch.Tensor, blocks: Int4Blocks) -> torch.Tensor:
    """The product "int4-q8" computes, in float64 from the same rounded rows: each block of 32 features rounded to
    bytes (scale d = amax / 127, nearest even), sum(w_q q) exact, times d_w d (one fp32 product), plus m_w d sum(q)."""
    rows, features = x.shape
    xb = x.reshape(rows, features // GROUP, GROUP)
    amax = xb.abs().amax(-1)
    q = torch.round(xb * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))[..., None])
    d = amax / 127.0
    weights = blocks.q.reshape(blocks.q.shape[0], -1, GROUP).double()
    sums = torch.einsum("rbe,nbe->rnb", q.double(), weights)
    scales = (blocks.scale[None] * d[:, None]).double()  # fp32 products, as the kernel rounds them
    offsets = blocks.offset.double()[None] * (d * q.sum(-1))[:, None].double()
    return (sums * scales + offsets).sum(-1)


@needs_native
@pytest.mark.parametrize("kind,extra_rows,groups", [("Q4_0", 0, 8), ("Q4_1", 0, 8), ("Q4_1", 0, 18), ("Q8_0", 0, 8),
                                                    ("Q8_0", 3, 18), ("Q4_1", 0, 3)])
@torch.no_grad()
def test_int8_rows_multiply_as_llama_cpp_and_every_row_comes_out_as_alone(kind, extra_rows, groups):
    """int4-q8: rows rounded to 8-bit blocks and multiplied in integers (the reference's value to fp32 rounding), each
    row bit for bit whatever the rows with it (few rows and many run different loops) and the threads; rows the
    blocks lack multiply the fp32 rows as they are. Blocks a row: 8, 18 (the embedded model's 576 features, where
    the kernel's scales are read eight blocks at a time, the last eight overlapping) and 3 (fewer than eight)."""
    layer, blocks = layer_on_blocks(groups * GROUP, 48, bias=True, dtype=torch.float32, kind=kind,
                                    extra_rows=extra_rows)
    bias, tail = layer.bias.detach().clone(), layer.weight.detach()[48:].clone()
    int4.switch_to_int4(layer, *int4.pack(blocks, torch.float32), int4.Int4Q8Linear)
    x = torch.randn(140, groups * GROUP)  # past the kernel's blocks of 64 rows
    x[3] = 0.0  # a row of zeros: scale 0
    out = layer(x)
    expected = int8_rows_reference(x, blocks) + bias[:48].double()
    torch.testing.assert_close(out[:, :48].double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[:, 48:], x @ tail.t() + bias[48:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, x @ layer.weight.t() + bias, rtol=1e-5, atol=1e-5)  # the rows were rounded
    assert_rows_as_alone(layer, x, (1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 70, 140))
    assert int4.int8_rows_match()


@needs_native
def test_fp32_blocks_fit_only_whole_tiles_and_never_more_rows_than_the_weight():
    layer, blocks = layer_on_blocks(2 * GROUP, 40, dtype=torch.float32)
    assert not int4.can_switch(layer, 40)  # not a multiple of PACK_MULTIPLE
    assert not int4.can_switch(layer, 48) and int4.can_switch(layer, 32)
    bf16 = nn.Linear(2 * GROUP, 48, dtype=torch.bfloat16)
    assert int4.can_switch(bf16) and not int4.can_switch(bf16, 32) and not int4.can_switch(bf16, bits=8)
    with pytest.raises(ValueError, match="blocks of shape"):
        int4.check_blocks(nn.Linear(2 * GROUP, 32), blocks)


@torch.no_grad()
def test_int4_product_is_the_blocks_weight_and_every_row_comes_out_as_alone():
    layer, blocks = layer_on_blocks(4 * GROUP, 64, bias=True)
    int4.check_blocks(layer, blocks)
    reference = nn.Linear(4 * GROUP, 64, bias=True, dtype=torch.bfloat16)
    reference.load_state_dict(layer.state_dict())
    int4.switch_to_int4(layer, *int4.pack(blocks))
    assert type(layer) is Int4Linear
    x = torch.randn(2, 20, 4 * GROUP).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), reference(x), rtol=2e-2, atol=2e-2)
    alone = torch.cat([layer(x[:, i:i + 1]) for i in range(20)], dim=1)
    for width in (1, 2, 5, 20):
        assert torch.equal(layer(x[:, :width]), alone[:, :width]), width
    assert set(layer.state_dict()) == {"weight", "bias"}  # the blocks are not part of the model's state


@torch.no_grad()
def test_blocks_that_do_not_describe_the_weight_are_refused():
    layer, blocks = layer_on_blocks(2 * GROUP, 32)
    layer.weight[3, 5] += 0.5  # an adapter merged into the weight
    with pytest.raises(ValueError, match="not the file's 4-bit blocks"):
        int4.check_blocks(layer, blocks)


def test_a_weight_written_after_the_switch_is_not_multiplied_by_stale_blocks():
    layer, blocks = layer_on_blocks(2 * GROUP, 32)
    int4.switch_to_int4(layer, *int4.pack(blocks))
    x = torch.randn(3, 2 * GROUP).to(torch.bfloat16)
    layer(x).float().sum().backward()  # grad enabled: the plain product, with autograd
    torch.optim.SGD(layer.parameters(), lr=1.0).step()
    with torch.no_grad(), pytest.raises(RuntimeError, match="load the model again"):
        layer(x)


def llama_gguf(tmp_path, model, head: bool = False) -> str:
    """Write a tiny Llama's linear layers into a GGUF file the way llama.cpp's converter does (Q4_1, llama's
    q/k row order, its tensor names; with `head`, the LM head in Q8_0), and set the model's weights to what the
    file holds."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    config = model.config
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for name, layer in model.named_modules():
        if type(layer) is not nn.Linear or (name == "lm_head" and not head):
            continue
        weight = layer.weight.detach().float()
        if name.endswith(("q_proj", "k_proj")):  # llama.cpp's permute(): rotary halves interleaved per head
            heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
            weight = weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)
        kind = "Q8_0" if name == "lm_head" else "Q4_1"
        raw, blocks = quantized(weight, kind)
        writer.add_tensor(names.get_name(name) + ".weight", raw, raw_dtype=GGMLQuantizationType[kind])
        with torch.no_grad():
            dequantized = blocks.dequantize()
            if name.endswith(("q_proj", "k_proj")):  # back to the model's row order
                dequantized = dequantized.reshape(heads, dequantized.shape[0] // heads // 2, 2, -1).swapaxes(1, 2)
            layer.weight.copy_(dequantized.reshape(layer.weight.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(tmp_path / "tiny.gguf")


def tiny_int4_llama(tmp_path, monkeypatch, dtype: torch.dtype = torch.bfloat16, head: bool = False,
                    attention: str = row_exact.EXACT_ATTENTION):
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, dtype=dtype, attn_implementation=attention)
    return model, llama_gguf(tmp_path, model, head)


@torch.no_grad()
def test_gguf_blocks_come_back_in_the_rows_and_names_transformers_gives(tmp_path, monkeypatch):
    model, path = tiny_int4_llama(tmp_path, monkeypatch)
    blocks = int4.read_gguf_blocks(path, model)
    layers = dict(model.named_modules())
    assert len(blocks) == 7 * model.config.num_hidden_layers
    for name, layer_blocks in blocks.items():
        assert torch.equal(layer_blocks.dequantize().to(torch.bfloat16), layers[name].weight), name


def test_prepare_int4_decodes_the_exact_mode_as_autoregressive_decoding(tmp_path, monkeypatch):
    """Every linear layer multiplies by 4-bit blocks or packed bf16 weights, each row as alone: the exact mode is
    AR decoding token for token, a batch decodes each sequence as alone, and a second prepare reads the cache."""
    model, path = tiny_int4_llama(tmp_path, monkeypatch)
    plain = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, dtype=torch.bfloat16,
                       attn_implementation=row_exact.EXACT_ATTENTION)
    plain.load_state_dict(model.state_dict())
    setup = prepare(model, weights_file=path, linear="int4")
    assert setup.kernels.linear == "int4" and "14 of 15" in setup.kernels.reason
    assert sum(type(m) is Int4Linear for m in model.modules()) == 14
    assert setup.row_exact == row_exact.packing_available()  # the LM head is packed only where the CPU has native bf16
    prompts = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9, 12, 13]]
    ar = refusion.DecodeConfig(max_new_tokens=24, strategy="autoregressive", eos_token_id=2)
    alone = [refusion.generate(model, [p], ar).sequences[0] for p in prompts]
    if setup.row_exact:
        for draft_length in (1, 4):
            cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=draft_length,
                                        eos_token_id=2)
            assert refusion.generate(model, prompts, cfg).sequences == alone, draft_length
        assert refusion.generate(model, prompts, ar).sequences == alone
    again = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, dtype=torch.bfloat16,
                       attn_implementation=row_exact.EXACT_ATTENTION)
    again.load_state_dict(plain.state_dict())
    prepare(again, weights_file=path, linear="int4")  # from the cache this time
    assert [refusion.generate(again, [p], ar).sequences[0] for p in prompts] == alone


def test_int4_is_refused_in_one_line_where_it_cannot_hold(tmp_path, monkeypatch):
    model, path = tiny_int4_llama(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="GGUF file"):
        prepare(model, linear="int4")
    fp16 = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype='float32' or 'bfloat16'"):
        prepare(fp16, weights_file=path, linear="int4")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match="not the file's 4-bit blocks"):
        prepare(model, weights_file=path, linear="int4")
    assert getattr(model, "refusion_setup", None) is None and setup_of(model).prepared is False


@needs_native
def test_fp32_int4_decodes_the_exact_mode_and_batches_as_autoregressive_decoding(tmp_path, monkeypatch):
    """fp32 with exact attention: every layer, the Q8_0 LM head too, multiplies by the file's blocks, every row as
    alone, so the exact mode is AR decoding and a batch decodes each sequence as alone; and the plain fp32 model
    (the same weights, F.linear's order of summation) gives AR's logits to rounding."""
    model, path = tiny_int4_llama(tmp_path, monkeypatch, torch.float32, head=True)
    plain = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, attn_implementation=row_exact.EXACT_ATTENTION)
    plain.load_state_dict(model.state_dict())
    setup = prepare(model, weights_file=path, linear="int4")
    assert setup.kernels.linear == "int4" and "15 of 15" in setup.kernels.reason and setup.row_exact
    assert_exact_mode_and_batches_decode_as_ar(model)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


PROMPTS = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9, 12, 13]]
"""Token ids of the tiny model's decoding tests."""


def assert_exact_mode_and_batches_decode_as_ar(model) -> None:
    """The exact mode (one draft and four) and AR decoding of PROMPTS as a batch give AR decoding's tokens alone."""
    ar = refusion.DecodeConfig(max_new_tokens=24, strategy="autoregressive", eos_token_id=2)
    alone = [refusion.generate(model, [p], ar).sequences[0] for p in PROMPTS]
    for draft_length in (1, 4):
        cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=draft_length,
                                    eos_token_id=2)
        assert refusion.generate(model, PROMPTS, cfg).sequences == alone, draft_length
    assert refusion.generate(model, PROMPTS, ar).sequences == alone


@needs_native
def test_int8_rows_decode_the_exact_mode_and_batches_as_autoregressive_decoding(tmp_path, monkeypatch):
    """int4-q8, pinned: every layer and the Q8_0 head multiply rounded rows, every row as alone, so the exact mode is
    its AR decoding and a batch decodes each sequence as alone; its logits are int4's to the rows' rounding."""
    model, path = tiny_int4_llama(tmp_path, monkeypatch, torch.float32, head=True)
    blocks = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, attn_implementation=row_exact.EXACT_ATTENTION)
    blocks.load_state_dict(model.state_dict())  # the same weights, fp32 rows ("int4")
    setup = prepare(model, weights_file=path, linear="int4-q8")
    assert setup.kernels.linear == "int4-q8" and "15 of 15" in setup.kernels.reason and setup.row_exact
    assert sum(type(m) is int4.Int4Q8Linear for m in model.modules()) == 15
    prepare(blocks, weights_file=path, linear="int4")
    assert_exact_mode_and_batches_decode_as_ar(model)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, blocks(ids).logits
    assert not torch.equal(ours, theirs)
    assert (ours - theirs).abs().amax() < 0.05 * theirs.abs().amax()


@needs_native
def test_int8_rows_are_refused_in_one_line_for_bf16_models(tmp_path, monkeypatch):
    model, path = tiny_int4_llama(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="linear='int4-q8' rounds fp32 rows"):
        prepare(model, weights_file=path, linear="int4-q8")
    assert not any(isinstance(m, Int4Linear) for m in model.modules())


@needs_native
def test_auto_multiplies_fp32_gguf_models_by_their_blocks_and_nothing_else(tmp_path, monkeypatch):
    """"auto" takes int4 for an fp32 model whose weights are its GGUF file's blocks, where the kernel runs vectorized;
    a bf16 model, a model without a GGUF file, and one whose weights are no longer the file's get the other kernels."""
    model, path = tiny_int4_llama(tmp_path, monkeypatch, torch.float32, head=True)
    setup = prepare(model, weights_file=path)
    assert (setup.kernels.linear == "int4") == int4.blocks_vectorized()
    if setup.kernels.linear == "int4":
        assert "15 of 15" in setup.kernels.reason
    bf16, bf16_path = tiny_int4_llama(tmp_path, monkeypatch)
    assert prepare(bf16, weights_file=bf16_path).kernels.linear != "int4"
    assert prepare(tiny_model("llama", hidden_size=128, heads=4, kv_heads=2)).kernels.linear != "int4"
    merged, merged_path = tiny_int4_llama(tmp_path, monkeypatch, torch.float32, head=True)
    with torch.no_grad():
        merged.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # an adapter merged into it
    assert prepare(merged, weights_file=merged_path).kernels.linear != "int4"
    assert not any(isinstance(m, Int4Linear) for m in merged.modules())


@pytest.mark.slow
def test_the_embedded_model_decodes_with_its_shipped_blocks():
    model, tokenizer = refusion.load(linear="int4", dtype="bfloat16")  # int4's activations are bf16 on every CPU
    setup = setup_of(model)
    assert setup.kernels.linear == "int4" and "210 of" in setup.kernels.reason
    ids = refusion.encode_prompts(tokenizer, "Name three colors.")
    ar = refusion.generate(model, ids, strategy="autoregressive", max_new_tokens=24).sequences
    assert setup.row_exact == row_exact.packing_available()
    assert refusion.generate(model, ids, strategy="speculative", max_new_tokens=24).sequences == ar


@needs_native
@pytest.mark.slow
def test_the_embedded_model_in_fp32_multiplies_its_shipped_blocks_head_too():
    """fp32: the 210 Q4_1 layers and the Q8_0 head (the embedding's blocks, plus the mask token's row) by refusion's
    kernel: the plain fp32 model's weights, so its greedy answer is the plain model's here."""
    model, tokenizer = refusion.load(linear="int4", dtype="float32")
    setup = setup_of(model)
    assert setup.kernels.linear == "int4" and "211 of 211" in setup.kernels.reason
    ids = refusion.encode_prompts(tokenizer, "Name three colors.")
    ours = refusion.generate(model, ids, strategy="autoregressive", max_new_tokens=24).sequences
    plain, _ = refusion.load(linear="plain", dtype="float32")
    assert refusion.generate(plain, ids, strategy="autoregressive", max_new_tokens=24).sequences == ours


@needs_native
@pytest.mark.slow
def test_the_embedded_model_with_int8_rows_decodes_the_exact_mode_as_its_ar():
    """int4-q8 on the embedded model: all 211 products round their rows, with exact attention over fp16 entries
    (`default_attention`) every row is computed as alone, and its exact mode is its own AR decoding."""
    model, tokenizer = refusion.load(linear="int4-q8", dtype="float32")
    setup = setup_of(model)
    assert setup.kernels.linear == "int4-q8" and "211 of 211" in setup.kernels.reason and setup.row_exact
    ids = refusion.encode_prompts(tokenizer, ["Name three colors.", "What is 12 times 7?"])
    ar = refusion.generate(model, ids, strategy="autoregressive", max_new_tokens=24).sequences
    assert refusion.generate(model, ids, strategy="speculative", max_new_tokens=24).sequences == ar


@needs_native
def test_int8_rows_over_fp16_entries_decode_the_exact_mode_and_batches_as_autoregressive_decoding(tmp_path,
                                                                                                  monkeypatch):
    """int4-q8 with its default attention, exact attention over fp16 KV entries (llama.cpp's cache): the decoder
    keeps fp16 entries, the exact mode is its AR decoding and a batch decodes each sequence as alone (the C++
    layers against the Python ones: tests/model/test_native.py)."""
    from refusion.decode import loop

    attention = loading.default_attention(torch.device("cpu"), torch.float32, "int4-q8")
    assert attention == row_exact.EXACT_HALF_ATTENTION
    model, path = tiny_int4_llama(tmp_path, monkeypatch, torch.float32, head=True, attention=attention)
    setup = prepare(model, weights_file=path, linear="int4-q8")
    assert setup.row_exact and loop.Decoder(model).cache.kv_dtype == torch.float16
    assert_exact_mode_and_batches_decode_as_ar(model)
