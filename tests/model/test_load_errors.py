"""`refusion generate --model` with something that is not a model: one line naming the problem, exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from refusion.cli import main


def _generate_error(model: Path, capsys) -> str:
    assert main(["generate", "hello", "--model", str(model), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_directory_with_only_a_config_names_what_is_missing(tiny_model_dir, tmp_path, capsys):
    shutil.copy(Path(tiny_model_dir) / "config.json", tmp_path / "config.json")
    err = _generate_error(tmp_path, capsys)
    assert "no weights" in err and "no tokenizer files" in err and str(tmp_path) in err
    assert "sentencepiece" not in err


@pytest.mark.parametrize("keep,missing,present", [
    (("config.json", "model.safetensors"), "no tokenizer files", "no weights"),
    (("config.json", "tokenizer.json", "tokenizer_config.json"), "no weights", "no tokenizer files"),
])
def test_a_directory_without_weights_or_tokenizer(tiny_model_dir, tmp_path, capsys, keep, missing, present):
    for name in keep:
        shutil.copy(Path(tiny_model_dir) / name, tmp_path / name)
    err = _generate_error(tmp_path, capsys)
    assert missing in err and present not in err


def test_an_existing_text_file_is_not_a_model(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("not a model\n")
    err = _generate_error(path, capsys)
    assert "is not a model" in err and "model directory" in err and ".gguf" in err and "does not exist" not in err


def test_a_missing_path_still_says_it_does_not_exist(tmp_path, capsys):
    assert "does not exist" in _generate_error(tmp_path / "nothing-here", capsys)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_weights_file_is_one_line_naming_it(tiny_model_dir, tmp_path, capsys, damage):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00" * 64)
    err = _generate_error(model_dir, capsys)
    assert str(weights) in err and "Traceback" not in err
    assert data != weights.read_bytes()  # reported, never rewritten
