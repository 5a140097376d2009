"""Where data files come from (`refusion.data_files`): a named folder only, else the folders beside the project,
the hub copies, then the hub through `datasets` (scripted here: no test downloads), with one-line errors; and the
one JSONL reader (`refusion.jsonl`)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import types

import pytest

from refusion import data_files
from refusion.data import builtin_train_pairs
from refusion.eval.tasks import load_examples
from refusion.jsonl import jsonl_records, read_jsonl


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No data folder named or beside the project, and the hub copies in an empty folder of their own."""
    monkeypatch.delenv(data_files.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(data_files, "local_folders", lambda: [tmp_path / "cwd-shared", tmp_path / "beside"])
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    return tmp_path


def fake_datasets(monkeypatch, splits: dict[tuple[str, str | None, str], list[dict]]):
    """A `datasets` module whose load_dataset serves `splits` by (hub id, config, split) and records each call."""
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return splits[(name, config, split)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(data_files, "hub_unavailable", lambda: None)
    return calls


def test_a_named_folder_is_the_only_place_looked(sample_data_dir, tmp_path, monkeypatch):
    assert data_files.data_file("gsm8k/test.jsonl", sample_data_dir) == sample_data_dir / "gsm8k/test.jsonl"
    monkeypatch.setenv(data_files.DATA_DIR_ENV, str(sample_data_dir))
    assert data_files.data_file("gsm8k/test.jsonl") == sample_data_dir / "gsm8k/test.jsonl"
    fake_datasets(monkeypatch, {})  # the hub would answer, but a named folder is not second-guessed
    with pytest.raises(FileNotFoundError) as e:
        load_examples("gsm8k", tmp_path)
    message = str(e.value)
    assert message == (f"task gsm8k needs gsm8k/test.jsonl, not found in {tmp_path}: pass --data-dir DIR "
                       f"(or set REFUSION_DATA_DIR=DIR) with DIR holding gsm8k/test.jsonl")


def test_the_folders_beside_the_project_then_the_hub_copies(nowhere, sample_data_dir, monkeypatch):
    copy = nowhere / "cache" / "data" / "gsm8k" / "train.jsonl"
    copy.parent.mkdir(parents=True)
    copy.write_text(json.dumps({"question": "copied?", "answer": "#### 1"}) + "\n")
    assert data_files.data_file("gsm8k/train.jsonl") == copy
    beside = nowhere / "beside"
    (beside / "gsm8k").mkdir(parents=True)
    (beside / "gsm8k" / "train.jsonl").write_text((sample_data_dir / "gsm8k" / "train.jsonl").read_text())
    assert data_files.data_file("gsm8k/train.jsonl") == beside / "gsm8k" / "train.jsonl"
    assert data_files.default_data_dir() == beside


def test_offline_or_without_datasets_the_error_says_where_it_looked(nowhere, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # CI sets it: the message names the first setting found
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        list(builtin_train_pairs("gsm8k"))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("built-in data set 'gsm8k' needs gsm8k/train.jsonl, found neither in ")
    for folder in ("cwd-shared", "beside", "cache/data"):
        assert str(nowhere / folder) in message
    assert "(HF_DATASETS_OFFLINE is set)" in message and "--data-dir DIR" in message
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert data_files.hub_unavailable() == "the datasets package is not installed: pip install 'refusion[data]'"
    with pytest.raises(FileNotFoundError, match="humanevalplus_mini.* on the hub \\(not there in this format\\)"):
        load_examples("humaneval_plus_mini")


def test_a_file_read_from_the_hub_is_the_folders_file_and_is_kept(nowhere, sample_data_dir, monkeypatch):
    local = read_jsonl(sample_data_dir / "arc_challenge" / "ARC-Challenge-Test.jsonl")
    hub_rows = [{"id": r["id"], "question": r["question"]["stem"],
                 "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                             "label": [c["label"] for c in r["question"]["choices"]]},
                 "answerKey": r["answerKey"]} for r in local]  # allenai/ai2_arc's shape
    calls = fake_datasets(monkeypatch, {("allenai/ai2_arc", "ARC-Challenge", "test"): hub_rows})
    examples = load_examples("arc_challenge", limit=5)
    assert calls == [("allenai/ai2_arc", "ARC-Challenge", "test")]
    assert examples == load_examples("arc_challenge", sample_data_dir, limit=5)  # as read from the folder
    copy = nowhere / "cache" / "data" / "arc_challenge" / "ARC-Challenge-Test.jsonl"
    assert read_jsonl(copy) == local
    load_examples("arc_challenge", limit=5)
    assert len(calls) == 1  # the copy is read, the hub not asked again


def test_a_file_of_several_splits_and_configs_keeps_their_order(nowhere, monkeypatch):
    rows = {("google-research-datasets/mbpp", "full", split): [{"task_id": task_id, "text": split}]
            for split, task_id in zip(data_files.MBPP_SPLITS, (1, 11, 511, 601), strict=True)}
    fake_datasets(monkeypatch, rows)
    path = data_files.data_file("mbpp/mbpp.jsonl")
    assert [r["task_id"] for r in read_jsonl(path)] == [1, 11, 511, 601]
    subjects = {("EleutherAI/hendrycks_math", subject, "test"): [{"problem": subject}]
                for subject in data_files.MATH_SUBJECTS}
    fake_datasets(monkeypatch, subjects)
    assert [r["problem"] for r in read_jsonl(data_files.data_file("math/test.jsonl"))] == list(data_files.MATH_SUBJECTS)


def test_a_failed_download_leaves_no_file_and_says_why(nowhere, monkeypatch):
    def load_dataset(*args, **kwargs):
        yield {"question": "q", "answer": "a"}
        raise ConnectionError("the connection dropped\nmore detail")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(data_files, "hub_unavailable", lambda: None)
    with pytest.raises(FileNotFoundError) as e:
        data_files.data_file("gsm8k/test.jsonl")
    assert str(e.value) == ("gsm8k/test.jsonl: reading openai/gsm8k from the hub failed "
                            "(ConnectionError: the connection dropped)")
    assert not any((nowhere / "cache" / "data" / "gsm8k").iterdir())


def test_starting_refusion_never_imports_datasets(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    code = ("import sys; from refusion.cli import build_parser; build_parser().format_help(); "
            "from refusion.decode.cli import read_prompt_file; import refusion.eval.tasks, refusion.train.data; "
            f"read_prompt_file({str(prompts)!r}); print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_jsonl_reader(tmp_path):
    path = tmp_path / "a.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('{"a": 1}\n\n  \n[2]\n')
    assert list(jsonl_records(path)) == [(1, {"a": 1}), (4, [2])]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError) as e:
        read_jsonl(bad)
    assert str(e.value) == f"{bad}:2: not valid JSON (Expecting value)"
