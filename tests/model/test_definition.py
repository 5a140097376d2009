"""refusion's own model definition (`model.definition`): transformers' logits bit for bit from the same weights, its
modules and state-dict keys, the same decoded tokens through the compact forward and through the model's own forward,
a loader that maps the weights file instead of copying it, and no transformers at import or while decoding."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import refusion
from refusion.model import definition
from refusion.model.compact import compact_forward
from refusion.model.definition import DecoderConfig, load_model, supports
from refusion.model.kernels import row_exact
from refusion.model.kernels.extension import native_extension
from refusion.model.kernels.row_exact import EXACT_ATTENTION, EXACT_HALF_ATTENTION
from refusion.model.prepare import add_mask_token
from refusion.model.setup import prepare, setup_of
from refusion.model.tiny import tiny_model, tiny_tokenizer

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {}),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "mistral-sliding": ("mistral", dict(sliding_window=4)),
}
"""Tiny models saved as transformers saves them: each family, a tied LM head, and sliding windows shorter than the
inputs (Qwen2: its second layer only)."""
ATTENTIONS = ["sdpa", "eager", EXACT_ATTENTION, EXACT_HALF_ATTENTION]
DTYPES = [torch.float32, torch.bfloat16]
PROMPTS = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9], [12, 13, 14, 15, 16]]


def save_variant(name: str, directory: Path, *, mask_token: bool = True) -> Path:
    arch, overrides = VARIANTS[name]
    model = tiny_model(arch, **overrides)
    if name.endswith("-tied"):
        model.config.tie_word_embeddings = True
        model.tie_weights()
    if not mask_token:
        del model.config.mask_token_id
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(name) -> the directory of VARIANTS[name] saved with `save_pretrained` (each saved once)."""
    root, directories = tmp_path_factory.mktemp("definition"), {}

    def get(name: str) -> Path:
        if name not in directories:
            directories[name] = save_variant(name, root / name)
        return directories[name]

    return get


def transformers_model(directory: Path, dtype: torch.dtype, attention: str):
    from transformers import AutoModelForCausalLM

    row_exact.register_with_transformers()
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=attention).eval()


def forward_inputs(dtype: torch.dtype, attention: str) -> dict[str, dict]:
    """Keyword arguments of the forwards compared: no mask, left padding, position ids, a 4D mask (a pattern
    of its own), logits of the last tokens, and one-token forwards."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 10), generator=generator)
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, :3] = 0
    padded_ids = ids.masked_fill(padding == 0, 0)
    seen = torch.ones(10, 10, dtype=torch.bool).tril()
    seen[6:, 2:5] = False  # later rows skip a few keys: not a causal mask
    seen4 = seen[None, None].expand(2, 1, 10, 10)
    additive = torch.zeros(seen4.shape, dtype=dtype).masked_fill(~seen4, torch.finfo(dtype).min)
    mask4 = seen4 if attention == "sdpa" else additive
    return {
        "causal": dict(input_ids=ids),
        "left padding": dict(input_ids=padded_ids, attention_mask=padding),
        "position ids": dict(input_ids=ids, position_ids=torch.arange(7, 17)[None].expand(2, -1)),
        "padding and positions": dict(input_ids=padded_ids, attention_mask=padding,
                                      position_ids=(padding.cumsum(-1) - 1).clamp(min=0)),
        "4D mask": dict(input_ids=ids, attention_mask=mask4, position_ids=torch.arange(10)[None].expand(2, -1)),
        "last tokens": dict(input_ids=ids, logits_to_keep=3),
        "one token": dict(input_ids=ids[:, :1]),
        "one token, 4D mask": dict(input_ids=ids[:, :1], attention_mask=mask4[:, :, :1, :1],
                                   position_ids=torch.zeros(2, 1, dtype=torch.long)),
    }


# --------------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_logits_equal_transformers_bit_for_bit(saved, variant, dtype, attention):
    ours = load_model(saved(variant), dtype, attention)
    theirs = transformers_model(saved(variant), dtype, attention)
    for name, inputs in forward_inputs(dtype, attention).items():
        with torch.no_grad():
            expected = theirs(**inputs, use_cache=False).logits
            got = ours(**inputs).logits
        assert got.dtype == dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("variant", ["qwen3", "mistral-sliding"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_forwards_over_a_cache_equal_transformers(saved, variant, attention):
    """A prefill and then one token at a time through a transformers DynamicCache (its `update` and
    `get_seq_length`), with left padding: the masks are built after the cached tokens."""
    from transformers import DynamicCache

    ours, theirs = load_model(saved(variant), torch.float32, attention), transformers_model(saved(variant),
                                                                                          torch.float32, attention)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :2] = 0
    caches = DynamicCache(), DynamicCache()
    for end in (6, 7, 8, 9):
        start = 0 if end == 6 else end - 1
        inputs = dict(input_ids=ids[:, start:end], attention_mask=padding[:, :end], use_cache=True)
        with torch.no_grad():
            expected = theirs(**inputs, past_key_values=caches[1]).logits
            got = ours(**inputs, past_key_values=caches[0]).logits
        assert torch.equal(got, expected), end


# ------------------------------------------------------------------------------------------ modules and config
@pytest.mark.parametrize("variant", VARIANTS)
def test_modules_and_state_dict_are_transformers(saved, variant):
    ours = load_model(saved(variant), torch.float32)
    theirs = transformers_model(saved(variant), torch.float32, "sdpa")
    mine, hf = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(hf)
    assert all(torch.equal(mine[k], hf[k]) and mine[k].dtype == hf[k].dtype for k in hf)
    assert torch.equal(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    tied = variant.endswith("-tied")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    for layer, hf_layer in zip(ours.model.layers, theirs.model.layers):
        attn, hf_attn = layer.self_attn, hf_layer.self_attn
        for name in ("layer_idx", "head_dim", "scaling", "num_key_value_groups", "is_causal"):
            assert getattr(attn, name) == getattr(hf_attn, name), name
        # Mistral's layers have no window of their own: its config's applies to every layer (Llama: none)
        expected_window = getattr(hf_attn, "sliding_window", getattr(theirs.config, "sliding_window", None))
        assert attn.sliding_window == expected_window
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                   layer.mlp.down_proj]
        assert all(type(m) is nn.Linear for m in linears) and type(layer.mlp.act_fn) is nn.SiLU
        assert layer.input_layernorm.variance_epsilon == hf_layer.input_layernorm.variance_epsilon
    assert ours.get_input_embeddings() is ours.model.embed_tokens and ours.get_output_embeddings() is ours.lm_head
    assert ours.dtype == torch.float32 and ours.device.type == "cpu" and not ours.training
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id


CONFIG_KEYS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "initializer_range", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
               "attention_dropout", "sliding_window", "rope_parameters"]
"""What refusion or the modules read from a config, compared with transformers' config of the same json."""


@pytest.mark.parametrize("family", definition.FAMILIES)
@pytest.mark.parametrize("values", [
    {},
    {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "head_dim": 32},
    {"rope_scaling": {"type": "default"}, "rope_theta": 20000, "tie_word_embeddings": True},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3},
    {"sliding_window": None, "eos_token_id": [2, 7]},
], ids=["defaults", "old rope_theta", "rope_parameters", "rope_scaling", "sliding", "no window"])
def test_config_reads_a_json_as_transformers_does(family, values):
    from transformers import AutoConfig

    values = {"model_type": family} | values
    theirs = AutoConfig.for_model(**values)
    ours = DecoderConfig.from_dict(values)
    for key in CONFIG_KEYS:
        assert getattr(ours, key, None) == getattr(theirs, key, None), key  # Llama has no sliding_window
    hf_head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == hf_head_dim
    assert getattr(ours, "layer_types", None) == getattr(theirs, "layer_types", None)
    assert ours.mask_token_id is None and ours.get_text_config() is ours
    assert ours.to_dict()["model_type"] == family and "_attn_implementation" not in ours.to_dict()
    ours.mask_token_id = 5
    ours._attn_implementation = "eager"
    assert ours.to_dict()["mask_token_id"] == 5


@pytest.mark.parametrize("values,reason", [
    ({"model_type": "gemma"}, "model_type"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE type"),
    ({"model_type": "qwen2", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "SiLU"),
    ({"model_type": "mistral", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen3", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}, "Qwen2ForCausalLM"),
    ({"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}, "quantized"),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types"),
    ({"model_type": "mistral", "layer_types": ["sliding_attention"]}, "layer_types"),
])
def test_supports_names_what_it_cannot_compute(values, reason, tmp_path):
    assert reason in supports(values)
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="does not support"):
        load_model(tmp_path, torch.float32)


def test_supports_the_families_as_saved(saved):
    for name in VARIANTS:
        assert supports(json.loads((saved(name) / "config.json").read_text())) is None, name
    assert supports({"model_type": "llama", "attention_bias": True, "mlp_bias": True}) is None  # Llama has both


# --------------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("arch,dtype,attention", [
    *[(arch, torch.float32, "sdpa") for arch in ("llama", "qwen2", "qwen3", "mistral")],
    *[(arch, torch.bfloat16, EXACT_ATTENTION) for arch in ("llama", "qwen2", "qwen3", "mistral")],
    ("qwen3", torch.float32, "eager"), ("qwen2-sliding", torch.bfloat16, "sdpa"),
], ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_decoding_gives_transformers_tokens(saved, arch, dtype, attention):
    """Each strategy decodes the tokens of transformers' model, through the compact forward (which runs this
    definition's own modules and functions) and through the model's own forward."""
    ours = load_model(saved(arch), dtype, attention)
    theirs = transformers_model(saved(arch), dtype, attention)
    for model in (ours, theirs):
        prepare(model, tiny_tokenizer(), linear="plain")
    compact = setup_of(ours).compact_forward
    assert compact is not None and compact_forward(ours) is compact
    assert compact.rotate is definition.apply_rotary_pos_emb
    assert compact.attention is definition.ATTENTION_FUNCTIONS[attention]
    if attention != "eager" and native_extension() is not None:
        assert compact.native is not None  # the C++ decoder layers run this definition's weights too
    for strategy in ("autoregressive", "speculative", "refusion"):
        cfg = refusion.DecodeConfig(max_new_tokens=24, strategy=strategy, eos_token_id=2)
        expected = refusion.generate(theirs, PROMPTS, cfg).sequences
        assert refusion.generate(ours, PROMPTS, cfg).sequences == expected, strategy
        own_forward = setup_of(ours).replace(compact=False, compact_forward=None)
        assert refusion.generate(ours, PROMPTS, cfg, setup=own_forward).sequences == expected, strategy


def test_adding_a_mask_token_gives_transformers_rows(tmp_path):
    """A model without a mask token gets one (`prepare.add_mask_token` writes its embedding and head rows into the
    mapped weights) exactly as transformers' model does; the file is not written."""
    directory = save_variant("qwen3", tmp_path / "model", mask_token=False)
    before = digest(directory / "model.safetensors")
    ours, theirs = load_model(directory, torch.float32), transformers_model(directory, torch.float32, "sdpa")
    ids = [add_mask_token(model, tiny_tokenizer(with_mask=False)) for model in (ours, theirs)]
    assert ids[0] == ids[1] == ours.config.mask_token_id == theirs.config.mask_token_id
    assert torch.equal(ours.model.embed_tokens.weight, theirs.model.embed_tokens.weight)
    assert torch.equal(ours.lm_head.weight, theirs.lm_head.weight)
    assert digest(directory / "model.safetensors") == before


@pytest.mark.parametrize("variant", ["llama", "llama-tied"])
def test_resizing_the_vocabulary_keeps_rows_and_ties(saved, variant):
    model = load_model(saved(variant), torch.float32)
    embed, head = model.model.embed_tokens.weight.clone(), model.lm_head.weight.clone()
    assert model.resize_token_embeddings(70) is model.model.embed_tokens
    assert model.model.embed_tokens.weight.shape == (70, 32) and model.lm_head.weight.shape == (70, 32)
    assert torch.equal(model.model.embed_tokens.weight[:64], embed)
    assert torch.equal(model.lm_head.weight[:64], head)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == variant.endswith("-tied")
    assert model.config.vocab_size == model.model.embed_tokens.num_embeddings == model.lm_head.out_features == 70
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 69]])).logits.shape == (1, 2, 70)
    with pytest.raises(ValueError, match="mean_resizing"):
        model.resize_token_embeddings(72, mean_resizing=True)


# --------------------------------------------------------------------------------------------------- loading
def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # stored in fp32: read as it is, or converted
def test_each_weight_is_read_into_memory_of_its_own(saved, dtype):
    """No weight shares memory with another (a kernel that re-lays one frees the original), but the tied head."""
    model = load_model(saved("llama-tied"), dtype)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]  # (the tied head listed once)
    assert len(set(storages)) == len(storages) and all(p.dtype == dtype for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_write_to_a_weight_never_reaches_the_file(saved, tmp_path):
    directory = Path(shutil.copytree(saved("qwen2"), tmp_path / "model"))
    before = digest(directory / "model.safetensors")
    model = load_model(directory, torch.float32)
    original = model.model.layers[0].self_attn.q_proj.bias.detach().clone()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.bias.fill_(7.0)
        model.model.embed_tokens.weight[5] = 3.0
    assert digest(directory / "model.safetensors") == before
    again = load_model(directory, torch.float32)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.bias, original)
    assert not torch.equal(again.model.embed_tokens.weight[5], torch.full((32,), 3.0))


def test_sharded_weights_load_as_one_file(saved, tmp_path):
    arch, overrides = VARIANTS["qwen3"]
    tiny_model(arch, **overrides).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, single = load_model(tmp_path, torch.float32), load_model(saved("qwen3"), torch.float32)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(sharded(input_ids=ids).logits, single(input_ids=ids).logits)


def damage(directory: Path, how: str) -> str:
    """Damage a copied model directory; returns the file the error must name."""
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    if how == "no config":
        (directory / "config.json").unlink()
        return "config.json"
    if how == "config not json":
        (directory / "config.json").write_text("{not json")
        return "config.json"
    if how == "no weights":
        weights.unlink()
        return "model.safetensors"
    if how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        weights.write_bytes(b"")
    elif how == "header too long":
        weights.write_bytes((len(data)).to_bytes(8, "little") + data[8:])
    elif how == "header not json":
        length = int.from_bytes(data[:8], "little")
        weights.write_bytes(data[:8] + b"x" * length + data[8 + length:])
    return "model.safetensors"


@pytest.mark.parametrize("how", ["no config", "config not json", "no weights", "truncated", "empty",
                                 "header too long", "header not json"])
def test_a_missing_or_damaged_file_is_one_line_naming_it(saved, tmp_path, how):
    directory = Path(shutil.copytree(saved("llama"), tmp_path / "model"))
    name = damage(directory, how)
    with pytest.raises(ValueError) as error:
        load_model(directory, torch.float32)
    message = str(error.value)
    assert name in message and len(message.splitlines()) == 1, message


def test_foreign_tensors_and_unknown_attention_are_refused(saved, tmp_path):
    with pytest.raises(ValueError, match="flash_attention_2"):
        load_model(saved("llama"), torch.float32, "flash_attention_2")
    directory = Path(shutil.copytree(saved("llama"), tmp_path / "model"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing model.layers.2"):
        load_model(directory, torch.float32)
    (directory / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    with pytest.raises(ValueError, match="shape"):
        load_model(directory, torch.float32)


# --------------------------------------------------------------------------------------------------- cold start
def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_the_definition_never_imports_transformers():
    out = run_python("""
        import sys
        import refusion.model.definition
        print(sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers.")))
    """)
    assert out.strip() == "[]"


def test_loading_and_decoding_a_defined_model_never_imports_transformers(saved):
    out = run_python(f"""
        import sys
        import torch
        import refusion
        from refusion.model.definition import load_model
        from refusion.model.setup import prepare

        model = load_model({str(saved("qwen3"))!r}, torch.float32, "sdpa")
        prepare(model, linear="plain")
        for strategy in ("autoregressive", "speculative", "refusion"):
            refusion.generate(model, [[1, 5, 7, 9]], max_new_tokens=8, strategy=strategy, eos_token_id=2)
        print(sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers.")))
    """)
    assert out.strip().splitlines()[-1] == "[]"
