"""Special tokens: resolved once (at load, or from a plain model's configs) into one frozen object."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import refusion
from refusion.config import DecodeConfig
from refusion.model.loading import load
from refusion.model.setup import setup_of
from refusion.model.special_tokens import SpecialTokens, resolve_special_tokens
from refusion.model.tiny import TINY_MASK_ID, tiny_model, tiny_tokenizer

MODEL_PACKAGE = Path(refusion.__file__).parent / "model"


def test_a_plain_model_is_resolved_from_its_configs():
    model = tiny_model()
    assert setup_of(model).special_tokens == SpecialTokens(TINY_MASK_ID, (2,), 0)
    model.config.mask_token_id = None
    assert setup_of(model).special_tokens.mask_token_id is None  # nothing was cached on a model load did not see
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup_of(model).special_tokens.mask_token_id = 5


def test_the_tokenizer_adds_the_mask_its_eos_and_the_end_of_turn_token():
    model = tiny_model()
    model.config.mask_token_id = None
    model.generation_config.eos_token_id = [17]
    tokens = resolve_special_tokens(model, tiny_tokenizer())
    assert tokens == SpecialTokens(TINY_MASK_ID, (17, 2), 0)  # generation config first, then <|im_end|>
    assert tokens.eos_token_id == 17
    assert resolve_special_tokens(model, tiny_tokenizer(with_mask=False)).mask_token_id is None


def test_decode_config_overrides_and_the_missing_mask_error():
    tokens = SpecialTokens(None, (2,), 0)
    assert tokens.for_decoding(DecodeConfig(strategy="autoregressive")) == tokens
    assert tokens.for_decoding(DecodeConfig(mask_token_id=7, eos_token_id=[])) == SpecialTokens(7, (), 0)
    assert tokens.for_decoding(DecodeConfig(strategy="autoregressive", eos_token_id=4)).eos_token_ids == (4,)
    for strategy in ("refusion", "speculative"):
        with pytest.raises(ValueError, match="mask_token_id is unknown"):
            tokens.for_decoding(DecodeConfig(strategy=strategy))


def test_generate_takes_a_setup_with_special_tokens_for_a_plain_model():
    model = tiny_model()
    model.config.mask_token_id = None  # a plain transformers model: its configs name no mask token
    prompts = [[1, 5, 7, 9], [1, 3, 4]]
    cfg = DecodeConfig(max_new_tokens=12, slot_size=2, block_size=4, eos_token_id=[])
    with pytest.raises(ValueError, match="mask_token_id is unknown"):
        refusion.generate(model, prompts, cfg)
    setup = setup_of(model).replace(special_tokens=SpecialTokens(TINY_MASK_ID, (2,)))
    given = refusion.generate(model, prompts, cfg, setup=setup)
    assert given.sequences == refusion.generate(tiny_model(), prompts, cfg).sequences


def test_load_attaches_the_tokens_without_writing_the_config(tmp_path):
    model = tiny_model()
    model.config.mask_token_id = None  # only the tokenizer knows <|mask|>
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, _ = load(tmp_path, dtype="float32", device="cpu")
    assert setup_of(loaded).special_tokens == SpecialTokens(TINY_MASK_ID, (2,), 0)
    assert getattr(loaded.config, "mask_token_id", None) is None
    out = refusion.generate(loaded, [[1, 5, 7]], max_new_tokens=8, slot_size=2, block_size=4)
    assert out.sequences[0]


def test_eos_default_is_the_generation_config_plus_the_tokenizer_eos(tmp_path):
    """docs/DECODING.md, "Special tokens": AR decoding stops where transformers' generate does on the loaded model,
    on the generation config's EOS ids and on the tokenizer's EOS."""
    model = tiny_model()
    model.generation_config.eos_token_id = 17  # the generation config's EOS ...
    model.save_pretrained(tmp_path)
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = "l"  # ... and another one in the tokenizer (id 15)
    tokenizer.save_pretrained(tmp_path)
    loaded, tokenizer = load(tmp_path, dtype="float32", device="cpu")
    assert tokenizer.eos_token_id == 15
    assert setup_of(loaded).special_tokens.eos_token_ids == (17, 15, 2)  # + <|im_end|>, the chat template's turn end
    prompts = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11]]
    out = refusion.generate(loaded, prompts, max_new_tokens=25, strategy="autoregressive")
    assert [s[-1] for s in out.sequences] == [15, 17]  # one stopped on the tokenizer's EOS, one on the config's
    reference, _ = load(tmp_path, dtype="float32", device="cpu", implementation="transformers")  # its `generate`
    assert setup_of(reference).special_tokens == setup_of(loaded).special_tokens
    for prompt, sequence in zip(prompts, out.sequences):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert sequence == expected


def test_model_package_has_no_import_cycle_and_no_facade_imports():
    imports = {}
    for path in MODEL_PACKAGE.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        assert "refusion" not in names, f"{path.name} imports the refusion facade"
        imports[path.stem] = {n.split(".")[2] for n in names if n.startswith("refusion.model.")}
    assert "loading" not in imports["embedded"] and "loading" not in imports["special_tokens"]
