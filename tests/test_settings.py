"""DecodeConfig is the one source of the decoding settings: every field reaches the command line, the server's
request schema, the lm-eval model arguments and the sweep axes without code of its own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from refusion.arguments import add_decode_arguments, decode_config_from_args
from refusion.config import (
    MODEL_FIELDS,
    ConfigError,
    DecodeConfig,
    field_docs,
    field_types,
    is_scalar,
    layered_config,
    layered_settings,
    parse_value,
)

FIELDS = [f.name for f in dataclasses.fields(DecodeConfig)]


def _parser(command: str) -> argparse.ArgumentParser:
    from refusion.cli import build_parser
    return build_parser()._subparsers._group_actions[0].choices[command]


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {action.dest for action in parser._actions}


def test_every_field_has_a_docstring():
    assert set(field_docs(DecodeConfig)) == set(FIELDS)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "eval", "bench"])
def test_every_field_is_a_flag(command):
    dests = _dests(_parser(command))
    # eval and bench have max_new_tokens and strategy flags of their own; bench sweeps the strategy
    assert set(FIELDS) - ({"strategy"} if command == "bench" else set()) <= dests


def test_every_field_is_in_the_server_schema_or_named_by_openai():
    pytest.importorskip("pydantic")
    from refusion.config import OPENAI_NAMES
    from refusion.serve.schemas import ChatCompletionRequest, RefusionOptions

    options = set(RefusionOptions.model_fields) - {"ignore_eos"}
    standard = {name for name in OPENAI_NAMES if OPENAI_NAMES[name] in ChatCompletionRequest.model_fields}
    assert options | standard | set(MODEL_FIELDS) == set(FIELDS)
    assert not options & (standard | set(MODEL_FIELDS))
    description = RefusionOptions.model_fields["draft_length"].description
    assert description == field_docs(DecodeConfig)["draft_length"]


def test_every_field_is_an_lm_eval_argument_and_every_scalar_one_a_sweep_axis():
    from refusion.eval.sweep import SWEEPABLE, parse_sweeps

    pytest.importorskip("lm_eval")
    from refusion.eval.lm_eval_plugin import DECODE_FIELDS, decode_settings

    assert set(DECODE_FIELDS) == set(FIELDS)
    assert decode_settings({"draft_length": 3, "fused_plan": "false", "eos_token_id": "2,7", "strategy": "speculative",
                            "pretrained": "x"}) == {"draft_length": 3, "fused_plan": False, "eos_token_id": [2, 7],
                                                    "strategy": "speculative"}
    scalar = {name for name in FIELDS if is_scalar(field_types(DecodeConfig)[name])}
    assert set(SWEEPABLE) == scalar - set(MODEL_FIELDS)
    assert parse_sweeps(["draft-length=2,3", "predraft=true,false", "strategy=speculative"]) == {
        "draft_length": [2, 3], "predraft": [True, False], "strategy": ["speculative"]}


def test_new_fields_arrive_as_flags_of_generate():
    args = _parser("generate").parse_args(["x", "--model", "m", "--strategy", "speculative", "--draft-length", "3",
                                           "--predraft", "--no-fused-plan", "--eos-token-id", "2,7"])
    cfg = decode_config_from_args(args)
    assert (cfg.strategy, cfg.draft_length, cfg.predraft, cfg.fused_plan, cfg.eos_token_id) == (
        "speculative", 3, True, False, [2, 7])
    untouched = decode_config_from_args(_parser("generate").parse_args(["x", "--model", "m"]))
    assert untouched == DecodeConfig()  # a flag not given is "not set", never the field's value


def test_flags_help_is_the_field_docstring(capsys):
    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "drafted tokens verified per forward" in help_text and "--no-fused-plan" in help_text


def test_layers_apply_in_order_and_none_means_not_set():
    assert layered_settings({"slot_size": 2}, "demo", {"block_size": 8, "seed": None}) == {
        "slot_size": 4, "slot_threshold": 0.6, "token_threshold": 0.3, "block_size": 8}
    assert layered_config(None, "demo", {"slot_size": 2}).slot_size == 2
    with pytest.raises(ConfigError) as err:
        layered_settings({"slot_sise": 4})
    assert err.value.field == "slot_sise"
    with pytest.raises(ValueError, match="unknown"):
        layered_settings("no-such-preset")


def test_values_from_text_and_token_id_validation():
    types = field_types(DecodeConfig)
    assert parse_value(types["seed"], "none") is None and parse_value(types["seed"], "7") == 7
    assert parse_value(types["eos_token_id"], "5") == 5 and parse_value(types["eos_token_id"], "5,6") == [5, 6]
    with pytest.raises(ValueError, match="not a valid bool"):
        parse_value(types["predraft"], "maybe")
    with pytest.raises(ConfigError, match="eos_token_id"):
        DecodeConfig(eos_token_id="</s>")
