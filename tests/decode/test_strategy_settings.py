"""Settings say when they do nothing (a field the chosen strategy never reads warns, in Python and the CLI, and is
refused by the server), and validation is total: types and ranges of every field and of generate's arguments."""

from __future__ import annotations

import ast
import math
import warnings
from pathlib import Path

import pytest

import refusion
from refusion.config import (
    STRATEGIES,
    STRATEGY_FIELDS,
    ConfigError,
    DecodeConfig,
    IgnoredSetting,
    layered_config,
)
from refusion.model.tiny import tiny_model

DECODE = Path(refusion.__file__).parent / "decode"
PROGRAM_OF = {"refusion": ["programs/plan_and_infill.py"],
              "speculative": ["programs/speculative.py", *(f"drafters/{p.name}" for p in (DECODE / "drafters").glob("*.py"))],
              "autoregressive": ["programs/autoregressive.py"]}
"""The modules of each strategy's program (the exact mode's drafters read its drafting fields)."""
CHANGED = {"slot_size": 2, "block_size": 16, "slot_threshold": 0.5, "token_threshold": 0.1, "fused_plan": False,
           "kv_cache": "recompute", "draft_length": 2, "draft_threshold": 0.3, "lookup_length": 4,
           "table_length": 4, "predraft": True}


def cfg_fields_read(modules: list[str]) -> set[str]:
    """The DecodeConfig fields program modules read (`cfg.<field>` / `seq.cfg.<field>`)."""
    fields = set()
    for node in (n for m in modules for n in ast.walk(ast.parse((DECODE / m).read_text()))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if owner == "cfg":
                fields.add(node.attr)
    return fields


def test_each_strategy_s_fields_are_read_by_its_program_and_no_other():
    for strategy, fields in STRATEGY_FIELDS.items():
        for other, module in PROGRAM_OF.items():
            read = cfg_fields_read(module) & set(fields)
            if other == strategy:
                assert read, (strategy, module)
            else:
                assert read == set(), f"{module} reads {read}, which only strategy {strategy!r} should read"
    assert set(CHANGED) == {f for fields in STRATEGY_FIELDS.values() for f in fields}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_field_the_strategy_ignores_warns_naming_field_and_strategy(strategy):
    for name, value in CHANGED.items():
        owner = next(o for o, fields in STRATEGY_FIELDS.items() if name in fields)
        settings = {name: value, **({"block_size": 16} if name == "slot_size" else {})}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = DecodeConfig(strategy=strategy, **settings)
        messages = [str(w.message) for w in caught if issubclass(w.category, IgnoredSetting)]
        if owner == strategy:
            assert messages == []
        else:
            assert any(m.startswith(f"{name}=") and f"strategy={strategy!r}" in m for m in messages), messages
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                cfg.for_strategy(strategy)  # back at the defaults: silent


def test_presets_and_defaults_drop_what_the_strategy_ignores_and_keep_what_the_user_set():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = DecodeConfig.from_preset("refusion-smol")
        plan = DecodeConfig.from_preset("refusion-smol", strategy="refusion")
        ar = layered_config("gsm8k", {"strategy": "autoregressive"})
    assert exact.strategy == "speculative" and exact.lookup_length == 8 and exact.slot_size == 8  # default
    assert plan.slot_size == 2 and plan.lookup_length == 0  # the preset's plan-and-infill settings, not its exact ones
    assert ar.slot_size == 8 and layered_config("gsm8k").slot_size == 32  # the paper's k for GSM8K: plan and infill
    with pytest.warns(IgnoredSetting, match="draft_length=3 is ignored by strategy='refusion'"):
        DecodeConfig.from_preset("refusion-smol", strategy="refusion", draft_length=3)
    model = tiny_model()
    with pytest.warns(IgnoredSetting, match="lookup_length=2 is ignored by strategy='autoregressive'"):
        refusion.generate(model, [[1, 5, 7]], exact, strategy="autoregressive", lookup_length=2, max_new_tokens=2)
    with warnings.catch_warnings():  # the config's own exact-mode fields were not set by this call: silent
        warnings.simplefilter("error")
        refusion.generate(model, [[1, 5, 7]], exact, strategy="autoregressive", max_new_tokens=2)


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", True), ("slot_size", 2.0), ("block_size", False), ("slot_threshold", True),
    ("token_threshold", math.nan), ("draft_threshold", "0.5"), ("temperature", math.inf), ("temperature", 1e-9),
    ("temperature", -1.0), ("seed", True), ("seed", 1.5), ("strategy", ["refusion"]), ("draft_length", True),
    ("lookup_length", -1), ("table_length", 2.5), ("predraft", 1), ("fused_plan", "yes"), ("kv_cache", None),
    ("mask_token_id", True), ("eos_token_id", [2, True]), ("eos_token_id", 2.0),
])
def test_every_field_checks_its_type_and_range(field, value):
    with pytest.raises(ConfigError) as error:
        DecodeConfig(**{field: value})
    assert error.value.field == field and str(error.value).startswith(f"{field}=")


def test_replace_names_an_unknown_field():
    with pytest.raises(ConfigError, match="unknown setting"):
        DecodeConfig().replace(slot=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"cfg": {"max_new_tokens": 4}}, "cfg must be a refusion.DecodeConfig"),
    ({"trace": "yes"}, "trace must be True or False"),
    ({"generator": 3}, "generator must be a torch.Generator"),
    ({"setup": "smol"}, "setup must be a refusion.ModelSetup"),
    ({"on_round": 5}, "on_round must be callable"),
    ({"slot": 4}, "unknown setting"),
])
def test_generate_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        refusion.generate(tiny_model(), [[1, 5, 7]], **kwargs)
    with pytest.raises(ValueError, match="model must be a transformers causal LM"):
        refusion.generate("tiny", [[1, 5, 7]])


def test_the_cli_warns_in_one_line_when_a_flag_does_nothing(tiny_model_dir, capsys):
    from refusion.cli import main

    assert main(["generate", "hello", "--model", str(tiny_model_dir), "--strategy", "refusion", "--draft-length",
                 "4", "--max-new-tokens", "4"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert err == ["refusion generate: warning: draft_length=4 is ignored by strategy='refusion': only "
                   "strategy='speculative' reads it"]

