"""ModelSetup: what refusion adds to a model, explicit, built once by `prepare` (which `load` calls), passed to
generate; a plain transformers model gets a clear default, and a weaker promise is never silent."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import refusion
from refusion.model.kernels import row_exact
from refusion.model.kernels.narrow import NarrowLinear
from refusion.model.prepare import add_mask_token
from refusion.model.setup import ModelSetup, Unprepared, plain_setup, prepare, setup_of
from refusion.model.tiny import TINY_MASK_ID, tiny_model, tiny_tokenizer


def test_load_prepares_the_model_once_and_the_setup_is_frozen(tiny_model_dir):
    model, _ = refusion.load(tiny_model_dir, dtype="float32", device="cpu")
    setup = refusion.setup_of(model)
    assert isinstance(setup, ModelSetup) and setup.prepared
    assert setup.special_tokens.mask_token_id == TINY_MASK_ID and setup.draft_table is None
    assert setup.kernels.attention == "sdpa" and setup.kernels.reason and not setup.row_exact
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.draft_table = None
    with pytest.raises(ValueError, match="already prepared"):
        prepare(model)


def test_a_plain_model_gets_a_clear_default():
    model = tiny_model()
    setup = setup_of(model)
    assert not setup.prepared and setup.kernels.linear == "plain" and "not prepared" in setup.kernels.reason
    assert setup == plain_setup(model) and setup.special_tokens.mask_token_id == TINY_MASK_ID
    assert "linear plain" in setup.describe()


@pytest.mark.parametrize("linear", ["plain", "narrow"])
def test_the_linear_kernel_can_be_pinned(tiny_model_dir, linear):
    model, _ = refusion.load(tiny_model_dir, dtype="float32", device="cpu", linear=linear)
    setup = setup_of(model)
    assert setup.kernels.linear == linear and setup.kernels.reason == "pinned by the caller"
    assert any(isinstance(m, NarrowLinear) for m in model.modules()) == (linear == "narrow")
    ids = [[1, 5, 7, 9]]
    plain = refusion.generate(tiny_model(), ids, max_new_tokens=6, strategy="autoregressive").sequences
    assert refusion.generate(model, ids, max_new_tokens=6, strategy="autoregressive").sequences == plain


def test_a_pin_that_cannot_hold_is_one_line_before_or_at_load(tiny_model_dir):
    with pytest.raises(ValueError, match="linear='fast' is invalid"):
        refusion.load(tiny_model_dir, linear="fast")
    with pytest.raises(ValueError, match="linear='packed' needs bf16"):
        refusion.load(tiny_model_dir, dtype="float32", device="cpu", linear="packed")
    with pytest.raises(ValueError, match="compile='yes' is invalid"):
        refusion.load(tiny_model_dir, dtype="float32", device="cpu", compile="yes")


def test_the_cli_takes_the_pins(tiny_model_dir, capsys):
    from refusion.cli import main

    assert main(["generate", "hi", "--model", str(tiny_model_dir), "--linear", "plain", "--attention", "eager",
                 "--max-new-tokens", "3", "--strategy", "autoregressive"]) == 0


def test_adding_the_mask_token_updates_a_prepared_setup():
    model, tokenizer = tiny_model(), tiny_tokenizer(with_mask=False)
    model.config.mask_token_id = None
    assert prepare(model, tokenizer).special_tokens.mask_token_id is None
    mask_id = add_mask_token(model, tokenizer)
    assert setup_of(model).special_tokens.mask_token_id == mask_id and setup_of(model).prepared


def test_an_unprepared_bf16_model_in_the_exact_mode_warns_once(monkeypatch):
    monkeypatch.setattr(row_exact, "packing_available", lambda: True)  # as on a CPU with native bf16
    model = tiny_model(dtype=torch.bfloat16)
    cfg = refusion.DecodeConfig(strategy="speculative", max_new_tokens=3, draft_length=1)
    with pytest.warns(UserWarning, match=r"refusion.prepare\(model, tokenizer\)"):
        refusion.generate(model, [[1, 5, 7]], cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refusion.generate(model, [[1, 5, 7]], cfg)  # once per model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refusion.generate(tiny_model(), [[1, 5, 7]], cfg)  # fp32: no weaker promise to report
    assert [w.category for w in caught] == [Unprepared]


def test_an_unprepared_model_is_named_once_and_a_prepared_one_never():
    model, cfg = tiny_model(), refusion.DecodeConfig(strategy="autoregressive", max_new_tokens=2)
    with pytest.warns(Unprepared, match=r"refusion.prepare\(model, tokenizer\)"):
        refusion.generate(model, [[1, 5, 7]], cfg)
    prepared = tiny_model()
    refusion.prepare(prepared, tiny_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refusion.generate(model, [[1, 5, 7]], cfg)  # once per model
        refusion.generate(prepared, [[1, 5, 7]], cfg)
