"""refusion.load: local directories, the mask token from the tokenizer, offline hub ids, GGUF."""

import json

import pytest
import torch

import refusion
from refusion.model import embedded
from refusion.model.setup import setup_of
from refusion.model.special_tokens import SpecialTokens
from refusion.model.tiny import TINY_MASK_ID, tiny_model, tiny_tokenizer


def test_local_directory_resolves_mask_from_tokenizer(tmp_path):
    model = tiny_model()
    model.config.mask_token_id = None  # only the tokenizer knows <|mask|>
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tokenizer = refusion.load(tmp_path, dtype="float32", device="cpu")
    assert setup_of(loaded).special_tokens == SpecialTokens(TINY_MASK_ID, (2,), 0)  # resolved once, at load
    assert getattr(loaded.config, "mask_token_id", None) is None  # and not written back into the config
    assert loaded.generation_config.eos_token_id in (2, [2])
    ids = refusion.encode_prompts(tokenizer, ["hello"])
    assert ids[0][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert refusion.generate(loaded, ids, max_new_tokens=4).sequences


def test_released_checkpoint_layout_loads_with_stock_classes(tmp_path):
    """The released model is a Qwen3ForCausalLM whose config points at remote code; stock classes must do."""
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_qwen3_refusion.Qwen3ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    stock, _ = refusion.load(tmp_path, dtype=torch.float32, device="cpu", implementation="transformers")
    assert type(stock).__name__ == "Qwen3ForCausalLM" and stock.config.mask_token_id == TINY_MASK_ID
    own, _ = refusion.load(tmp_path, dtype=torch.float32, device="cpu")  # refusion's definition: no remote code
    assert type(own).__module__ == "refusion.model.definition" and own.config.mask_token_id == TINY_MASK_ID
    ids = torch.tensor([[1, 5, 7, 9, TINY_MASK_ID, 11]])
    with torch.no_grad():
        assert torch.equal(own(ids).logits, stock(ids).logits)


def test_a_tokenizer_refusion_cannot_read_comes_from_transformers_beside_the_own_model(tmp_path, monkeypatch):
    """A model-specific tokenizer class (Qwen's) is transformers' to build; the model is still refusion's."""
    from transformers import PreTrainedTokenizerBase

    from refusion.model import tokenizer as own_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(own_tokenizer, "supports", lambda directory: "a model-specific tokenizer class")
    model, tokenizer = refusion.load(tmp_path, dtype=torch.float32, device="cpu")
    assert type(model).__module__ == "refusion.model.definition" and isinstance(tokenizer, PreTrainedTokenizerBase)
    with pytest.raises(ValueError, match="implementation='refusion' cannot load .*: model_type 'gpt2'"):
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
        refusion.load(tmp_path, dtype=torch.float32, device="cpu", implementation="refusion")


def test_offline_hub_id_and_missing_paths_give_clear_errors(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache, and the hub cannot be reached"):
        refusion.load("GSAI-ML/ReFusion")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        refusion.load("./no/such/model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        refusion.load("missing.gguf")
    with pytest.raises(ValueError, match="not a torch dtype"):
        refusion.load("smollm2", dtype="float12")
    with pytest.raises(ValueError, match="attn_implementation='bogus' is not an attention implementation: use one "
                                         "of eager, sdpa, refusion_exact, refusion_exact_half"):
        refusion.load("smollm2", attn_implementation="bogus")


@pytest.mark.slow
def test_smollm2_gguf_loads_as_plain_model_with_im_end_eos():
    model, tokenizer = refusion.load("smollm2", dtype=torch.float32, device="cpu")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in (
        [model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int)
        else model.generation_config.eos_token_id)
    assert getattr(model.config, "quantization_config", None) is None
    ids = refusion.encode_prompts(tokenizer, ["What is 12 times 7?"])
    out = refusion.generate(model, ids, max_new_tokens=160, strategy="autoregressive")
    assert out.stats.per_sequence[0].finish_reason == "eos"  # the turn ends with <|im_end|>


def test_without_embedded_model_the_default_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(embedded, "ADAPTER_DIR", embedded.ASSET_DIR / "missing")
    with pytest.raises(ValueError, match="ships no embedded default model"):
        refusion.load()
    with pytest.raises(ValueError, match="ships no embedded default model"):
        refusion.default_decode_settings()


@pytest.mark.skipif(not embedded.embedded_available(), reason="this build ships no embedded model")
def test_embedded_adapter_fits_the_package_budget():
    shipped = sum(p.stat().st_size for p in embedded.ADAPTER_DIR.rglob("*") if p.is_file())
    assert shipped <= 30 * 2**20  # the package budget for shipped weights


@pytest.mark.skipif(not embedded.embedded_available(), reason="this build ships no embedded model")
def test_embedded_adapter_names_a_base_every_machine_has():
    from refusion.model.adapter import ADAPTER_CONFIG, adapter_base

    recorded = json.loads((embedded.ADAPTER_DIR / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    assert recorded == adapter_base(embedded.ADAPTER_DIR) == "smollm2"  # not a path of the machine it was made on


@pytest.mark.slow  # loads SmolLM2-135M and decodes 128 tokens
@pytest.mark.skipif(not embedded.embedded_available(), reason="this build ships no embedded model")
def test_embedded_model_loads_offline_and_answers_with_its_preset():
    model, tokenizer = refusion.load(device="cpu")
    assert model.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>") == 49152
    settings = refusion.default_decode_settings()
    assert refusion.DecodeConfig(**settings) == refusion.DecodeConfig.from_preset(embedded.PRESET_NAME)
    ids = refusion.encode_prompts(tokenizer, ["Write a Python function that returns the square of a number."])  # the README's prompt
    out = refusion.generate(model, ids, refusion.DecodeConfig.from_preset(embedded.PRESET_NAME, max_new_tokens=128))
    stats = out.stats.per_sequence[0]
    assert stats.finish_reason == "eos" and stats.tokens > 1  # a complete answer, ended by <|im_end|>
    assert out.sequences[0][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # mask-gated adapter: AR decoding is the base model's own, and the exact mode gives the same answer
    base, _ = refusion.load("smollm2", dtype=model.dtype, device="cpu")
    ar = refusion.DecodeConfig(strategy="autoregressive", max_new_tokens=128)
    assert refusion.generate(model, ids, ar).sequences == refusion.generate(base, ids, ar).sequences
    if model.dtype == torch.float32 or model.config._attn_implementation == "refusion_exact":
        assert out.sequences == refusion.generate(model, ids, ar).sequences  # bf16 elsewhere: up to near-ties


@pytest.mark.skipif(not embedded.embedded_available(), reason="this build ships no embedded model")
def test_the_embedded_preset_in_a_batch_is_ar_decoding_of_each_request_alone():
    """Four requests decoded together by the preset (the holes each one's drafts leave between the others' keys, a
    padded prefill) give each the tokens AR decoding gives it alone: before exact attention's softmax ran over a
    row's own columns, some of these left AR's answer (at a4cd34a)."""
    model, tokenizer = refusion.load(device="cpu")
    if not (model.dtype == torch.float32 or model.config._attn_implementation == "refusion_exact"):
        pytest.skip("bf16 without row-exact products: up to near-ties")
    ids = refusion.encode_prompts(tokenizer, ["How does a refrigerator keep food cold?",
                                              "Summarise the causes of the French Revolution.",
                                              "Give three tips for learning a new language.", "Why is the sky blue?"])
    preset = refusion.DecodeConfig.from_preset(embedded.PRESET_NAME, max_new_tokens=128)
    alone = [refusion.generate(model, [p], preset.for_strategy("autoregressive")).sequences[0] for p in ids]
    assert refusion.generate(model, ids, preset).sequences == alone


def test_the_cpu_default_is_row_exact_bf16_where_the_cpu_has_it_else_fp32():
    """On the CPU the exact mode is AR decoding token for token in fp32, and bit for bit in row-exact bf16
    (refusion.model.kernels.row_exact); load picks the latter where this CPU has it, and uses it."""
    from refusion.model.kernels import row_exact
    from refusion.model.loading import default_dtype

    exact_bf16 = row_exact.packing_available() and row_exact.packed_rows_match()
    assert default_dtype(torch.device("cpu")) == (torch.bfloat16 if exact_bf16 else torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoding_passes_the_cache_by_the_keyword_the_model_takes(arch):
    """transformers renamed `past_key_values` to `cache`: decoding must not trip its deprecation warning (every
    `refusion generate` printed it), and must still drive a model whose forward only knows the old name."""
    import warnings

    from refusion.decode.cache import cache_keyword

    model = tiny_model(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = refusion.generate(model, [[5, 6, 7]], max_new_tokens=4, strategy="autoregressive")
    assert len(out.sequences[0]) == 4
    assert cache_keyword(model) in ("cache", "past_key_values")

    class OldSignature(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_keyword(OldSignature()) == "past_key_values"
