"""Weights as shipped (linear kernel "int4"): a GGUF file's 4-bit blocks read back exactly, in the rows and names
transformers gives them, multiplied row by row so that the exact mode stays AR decoding, and refused with one
line where they cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from torch import nn

import refusion
from refusion.model.kernels import int4, row_exact
from refusion.model.kernels.int4 import GROUP, Int4Blocks, Int4Linear
from refusion.model.setup import prepare, setup_of
from refusion.model.tiny import tiny_model

pytestmark = pytest.mark.skipif(not int4.int4_available(), reason="this torch build has no int4 CPU kernel")


def quantized(weight: torch.Tensor, kind: str = "Q4_1") -> tuple[np.ndarray, Int4Blocks]:
    """(raw GGUF rows, blocks) of a weight quantized as llama.cpp does."""
    raw = quants.quantize(weight.float().numpy(), GGMLQuantizationType[kind])
    q, d, m = int4._unpack_blocks(raw, kind)
    scale = torch.from_numpy(d)
    zero = torch.from_numpy(m) + 8 * scale if m is not None else torch.zeros_like(scale)
    return raw, Int4Blocks(torch.from_numpy(q), scale, zero)


@torch.no_grad()
def layer_on_blocks(in_features: int, out_features: int, bias: bool = False) -> tuple[nn.Linear, Int4Blocks]:
    """A bf16 layer whose weight is exactly what its Q4_1 blocks hold, and the blocks."""
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    _, blocks = quantized(layer.weight)
    layer.weight.copy_(blocks.dequantize())
    return layer, blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_unpack_to_what_gguf_dequantizes(kind):
    torch.manual_seed(0)
    raw, blocks = quantized(torch.randn(48, 4 * GROUP), kind)
    expected = quants.dequantize(raw, GGMLQuantizationType[kind])
    np.testing.assert_allclose(blocks.dequantize().numpy(), expected, rtol=0, atol=1e-6)


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


def llama_gguf(tmp_path, model) -> str:
    """Write a tiny Llama's linear layers into a GGUF file the way llama.cpp's converter does (Q4_1, llama's
    q/k row order, its tensor names), and set the model's weights to what the file holds."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    config = model.config
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for name, layer in model.named_modules():
        if type(layer) is not nn.Linear or name == "lm_head":
            continue
        weight = layer.weight.detach().float()
        if name.endswith(("q_proj", "k_proj")):  # llama.cpp's permute(): rotary halves interleaved per head
            heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
            weight = weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)
        raw, blocks = quantized(weight)
        writer.add_tensor(names.get_name(name) + ".weight", raw, raw_dtype=GGMLQuantizationType.Q4_1)
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


def tiny_int4_llama(tmp_path, monkeypatch):
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, dtype=torch.bfloat16,
                       attn_implementation=row_exact.EXACT_ATTENTION)
    return model, llama_gguf(tmp_path, model)


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
    fp32 = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        prepare(fp32, weights_file=path, linear="int4")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match="not the file's 4-bit blocks"):
        prepare(model, weights_file=path, linear="int4")
    assert getattr(model, "refusion_setup", None) is None and setup_of(model).prepared is False


@pytest.mark.slow
def test_the_embedded_model_decodes_with_its_shipped_blocks():
    model, tokenizer = refusion.load(linear="int4", dtype="bfloat16")  # int4's activations are bf16 on every CPU
    setup = setup_of(model)
    assert setup.kernels.linear == "int4" and "210 of" in setup.kernels.reason
    ids = refusion.encode_prompts(tokenizer, "Name three colors.")
    ar = refusion.generate(model, ids, strategy="autoregressive", max_new_tokens=24).sequences
    assert setup.row_exact == row_exact.packing_available()
    assert refusion.generate(model, ids, strategy="speculative", max_new_tokens=24).sequences == ar
