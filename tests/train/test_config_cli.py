"""TrainConfig validation, recipes, and the `refusion train` command line (flags are a contract)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from refusion.train import cli
from refusion.train.config import TrainConfig, field_docs

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(model="m", data=("d.jsonl",), output="out")


@pytest.mark.parametrize("changes, message", [
    (dict(max_steps=0), "max_steps=0"), (dict(max_steps=5, epochs=1.0), "either max_steps or epochs"),
    (dict(batch_size=0), "batch_size=0"), (dict(lr=-1.0), "lr=-1.0"), (dict(slot_sizes=()), "slot_sizes"),
    (dict(slot_sizes=(4, 0)), "slot_sizes"), (dict(objective="mdm"), "objective='mdm'"),
    (dict(mixed_precision="fp8"), "mixed_precision"), (dict(data=()), "data"), (dict(output=""), "output"),
    (dict(eos_slots=-1), "eos_slots"), (dict(grad_accum=1.5), "grad_accum"),
])
def test_invalid_values_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**BASE, **changes})


def test_every_field_has_a_docstring():
    import dataclasses

    assert set(field_docs(TrainConfig)) == {f.name for f in dataclasses.fields(TrainConfig)}


def _parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.add_parser(sub)
    return parser.parse_args(["train", *argv])


def test_contract_flags_parse_into_the_config():
    args = _parse(["--model", "m", "--data", "a.jsonl", "--data", "gsm8k", "--output", "o", "--max-steps", "7",
                   "--batch-size", "2", "--grad-accum", "3", "--lr", "1e-4", "--max-length", "256", "--save-every", "5",
                   "--lora", "--seed", "9", "--resume", "--log-every", "2", "--slot-sizes", "4,8"])
    assert args.func is cli.run
    config = cli.config_from_args(args)
    assert config.data == ("a.jsonl", "gsm8k") and config.max_steps == 7 and config.batch_size == 2
    assert config.grad_accum == 3 and config.lr == 1e-4 and config.max_length == 256 and config.save_every == 5
    assert config.lora and config.seed == 9 and config.resume == "latest" and config.log_every == 2
    assert config.slot_sizes == (4, 8)
    assert cli.config_from_args(_parse(["--model", "m", "--data", "d", "--output", "o", "--epochs", "2"])).epochs == 2


def test_recipe_values_are_overridden_by_flags(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: base\ndata: [x.jsonl]\noutput: o\nlr: 0.001\nslot_sizes: [4]\n")
    config = cli.config_from_args(_parse(["--config", str(recipe), "--lr", "0.5"]))
    assert (config.model, config.data, config.lr, config.slot_sizes) == ("base", ("x.jsonl",), 0.5, (4,))
    recipe.write_text("model: base\nlearning_rate: 1\n")
    with pytest.raises(ValueError, match="unknown setting.*learning_rate"):
        cli.config_from_args(_parse(["--config", str(recipe)]))
    with pytest.raises(FileNotFoundError, match="no such file or packaged recipe"):
        cli.config_from_args(_parse(["--config", "nope"]))


@pytest.mark.parametrize("content, message", [
    (b"max_steps: [\n", r"r\.yaml: not valid YAML \(.* at line 2, column 1\)"),
    (b"model: caf\xe9\n", r"r\.yaml is not UTF-8 text"),
])
def test_a_recipe_that_does_not_parse_is_one_line(tmp_path, capsys, content, message):
    from refusion.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        cli.config_from_args(_parse(["--config", str(recipe)]))
    assert main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("refusion train: error: --config ") and "\n" not in err


@pytest.mark.parametrize("name", cli.recipe_names())
def test_packaged_recipes_load(name):
    config = cli.config_from_args(_parse(["--config", name, "--output", "o", "--data", "d"]))
    assert config.model


def test_recipes_exist_once_and_the_scripts_name_packaged_ones():
    assert {"refusion-qwen3-8b", "smollm2-gsm8k-cpu", "smollm2-lora-cpu"} <= set(cli.recipe_names())
    assert not list((ROOT / "recipes").glob("*.yaml"))  # one copy: the packaged one
    for script in (ROOT / "recipes").glob("*.sh"):
        for name in re.findall(r"--config (\S+)", script.read_text()):
            assert name in cli.recipe_names(), f"{script.name}: --config {name} is not a packaged recipe"
    for config in ("cpu", "multi_cpu", "ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"):
        assert (ROOT / "accelerate_configs" / f"{config}.yaml").is_file()


def test_help_lists_the_contract_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--data", "--output", "--max-steps", "--epochs", "--batch-size", "--grad-accum", "--lr",
                 "--max-length", "--save-every", "--lora", "--seed", "--resume", "--config", "--log-every"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--data", "{tmp}/missing.jsonl"], "missing.jsonl does not exist"),
    (["--data", "{data}", "--resume"], "no checkpoint"),
    (["--data", "{data}", "--batch-size", "0"], "batch_size=0"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, tiny_dir, data_file, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, data=data_file) for a in argv]
    code = cli.main(["--model", str(tiny_dir), "--output", str(tmp_path / "out"), "--num-workers", "0", *argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("refusion train: error:") and message in last


@pytest.mark.parametrize("extra", [[], ["--overwrite"]])
@pytest.mark.parametrize("foreign", [{"notes.txt": "mine"}, {"config.json": "{}", "model.safetensors": "weights"}])
def test_a_non_empty_directory_that_is_not_a_run_is_refused(tmp_path, tiny_dir, data_file, capsys, foreign, extra):
    out = tmp_path / "someone-elses"
    out.mkdir()
    for name, text in foreign.items():
        (out / name).write_text(text)
    code = cli.main(["--model", str(tiny_dir), "--data", str(data_file), "--output", str(out), "--max-steps", "1",
                     "--num-workers", "0", "--save-every", "0", *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("refusion train: error:") and "holds no refusion training run" in lines[-1]
    assert sorted(p.name for p in out.iterdir()) == sorted(foreign)  # nothing written, nothing changed
    assert all((out / name).read_text() == text for name, text in foreign.items())


@pytest.mark.parametrize("field, value", [("lr", float("nan")), ("lr", True), ("mdm_weight", float("inf")),
                                          ("epochs", False), ("lora_dropout", float("nan")), ("max_steps", True)])
def test_numbers_are_finite_and_never_bools(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        TrainConfig(model="m", data=("d",), output="o", **{field: value})
