"""`refusion.generate(model, ids)` without a config decodes with the model's own preset (`ModelSetup.preset`: the
embedded model's, as the CLI without --model does), and a model without one with the DecodeConfig defaults."""

from __future__ import annotations

import pytest

import refusion
from refusion.model import embedded
from refusion.model.setup import setup_of
from refusion.model.tiny import tiny_model, tiny_tokenizer


def _decoded(out) -> list:
    """What a decode produced, its timings left out."""
    return [(seq, s.tokens, s.forwards, s.phase_forwards, s.committed_by, s.drafted, s.accepted)
            for seq, s in zip(out.sequences, out.stats.per_sequence, strict=True)]


def test_the_preset_belongs_to_the_embedded_model_only(tmp_path):
    assert embedded.preset_for(embedded.ADAPTER_DIR) == embedded.PRESET_NAME
    assert embedded.preset_for(str(embedded.ADAPTER_DIR) + "/") == embedded.PRESET_NAME
    assert embedded.preset_for(tmp_path) is None and embedded.preset_for(None) is None


def test_a_model_without_a_preset_decodes_with_the_defaults():
    model, tokenizer = tiny_model(), tiny_tokenizer()
    ids = [tokenizer("12+7=").input_ids, tokenizer("hello").input_ids]
    assert setup_of(model).preset is None  # a model refusion did not prepare (`prepare` sets it by `preset_for`)
    out = refusion.generate(model, ids, max_new_tokens=12)
    defaults = refusion.generate(model, ids, refusion.DecodeConfig(max_new_tokens=12))
    assert _decoded(out) == _decoded(defaults)
    assert "speculative" not in out.stats.per_sequence[0].committed_by  # plan and infill, DecodeConfig's default


def test_a_setup_with_a_preset_decodes_with_it():
    model, tokenizer = tiny_model(), tiny_tokenizer()
    ids = [tokenizer("12+7=").input_ids]
    setup = setup_of(model).replace(preset="demo")
    out = refusion.generate(model, ids, setup=setup, max_new_tokens=12)
    demo = refusion.generate(model, ids, refusion.DecodeConfig.from_preset("demo", max_new_tokens=12), setup=setup)
    assert _decoded(out) == _decoded(demo)
    assert _decoded(out) != _decoded(refusion.generate(model, ids, refusion.DecodeConfig(max_new_tokens=12)))


@pytest.mark.skipif(not embedded.embedded_available(), reason="this build ships no embedded model")
def test_the_embedded_model_decodes_with_its_preset_without_a_config():
    model, tokenizer = refusion.load(device="cpu")
    assert setup_of(model).preset == embedded.PRESET_NAME
    ids = refusion.encode_prompts(tokenizer, ["Why is the sky blue?"])
    out = refusion.generate(model, ids, max_new_tokens=16)
    preset = refusion.DecodeConfig.from_preset(embedded.PRESET_NAME, max_new_tokens=16)
    assert _decoded(out) == _decoded(refusion.generate(model, ids, preset))
    assert set(out.stats.per_sequence[0].committed_by) == {"speculative"}  # the exact mode, the preset's strategy


@pytest.mark.skipif(not embedded.embedded_available(), reason="this build ships no embedded model")
def test_building_the_defaults_never_warns_about_themselves():
    """`DecodeConfig(**default_decode_settings())` and the command line without --model (the README's first command)
    build their configs without a warning; a field the strategy ignores still warns when the user sets it."""
    import warnings

    from refusion.arguments import decode_config_from_args
    from refusion.cli import build_parser
    from refusion.config import IgnoredSetting

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = refusion.DecodeConfig(**refusion.default_decode_settings())
        assert cfg == refusion.DecodeConfig.from_preset(embedded.PRESET_NAME)
        for argv in (["generate", "Write a Python function that returns the square of a number.", "--stats"],
                     ["chat"], ["serve"]):
            assert decode_config_from_args(build_parser().parse_args(argv)) == cfg
        # another strategy on the command line takes the preset's settings for it
        refusion_cfg = decode_config_from_args(build_parser().parse_args(["generate", "hi", "--strategy", "refusion"]))
        assert refusion_cfg == refusion.DecodeConfig.from_preset(embedded.PRESET_NAME, strategy="refusion")
        assert refusion_cfg.slot_size == refusion.preset(embedded.PRESET_NAME)["slot_size"]
    with pytest.warns(IgnoredSetting, match="slot_size=4 is ignored by strategy='speculative'"):
        refusion.DecodeConfig(**refusion.default_decode_settings(), slot_size=4)
    with pytest.warns(IgnoredSetting, match="slot_size=4 is ignored"):
        decode_config_from_args(build_parser().parse_args(["generate", "hi", "--slot-size", "4"]))
