"""Where a file of the built-in data sets comes from: a data folder, else a copy made from the Hugging Face hub.

A data file is named by its path inside the data folder (`gsm8k/test.jsonl`: the layout of `../shared/data`,
whose README.md lists the sets). `data_file` finds it in this order:

1. the folder the caller names (`--data-dir`), else $REFUSION_DATA_DIR when set: that folder only;
2. `../shared/data` from the working directory, then `../shared/data` beside the project (a checkout's sibling);
3. the copy an earlier run made from the hub, in refusion's cache (`$REFUSION_CACHE/data`, else
   `~/.cache/refusion/data`);
4. the hub, through the `datasets` package (`pip install 'refusion[data]'`): the public data set, converted row
   by row to the folder's format and saved as that copy. Skipped, in a few seconds at most, when HF_HUB_OFFLINE
   or HF_DATASETS_OFFLINE is set, when the hub does not answer, or when `datasets` is not installed.

Anything else is a FileNotFoundError of one line naming where it looked and how to provide the file. `datasets`
is imported in step 4 only, never when refusion starts.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "REFUSION_DATA_DIR"
OFFLINE_ENVS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""Either set to 1 / true / yes / on: the hub is not asked for data (as `huggingface_hub` and `datasets` read
them)."""
HOW_TO_PROVIDE = f"pass --data-dir DIR (or set {DATA_DIR_ENV}=DIR) with DIR holding {{relative}}"
"""The end of the error for a missing file."""
HUB_TIMEOUT = 3.0
"""Seconds the hub has to answer a connection before it counts as unreachable."""


@dataclass(frozen=True)
class HubSource:
    """How one file of the data folder is rebuilt from a public data set on the Hugging Face hub."""

    dataset: str
    """The hub id, e.g. "openai/gsm8k"."""
    configs: tuple[str | None, ...]
    """Its configurations whose rows the file holds, in file order (None: the default one)."""
    splits: tuple[str, ...]
    """The splits of each configuration the file holds, in file order."""
    to_record: Callable[[dict], dict] = dict
    """A hub row as the folder's record (the same fields, unless the hub reshaped them)."""


def arc_record(row: dict) -> dict:
    """An ARC row of `allenai/ai2_arc` in AI2's original format (the folder's): question.stem, question.choices."""
    choices = [{"text": text, "label": label} for text, label in zip(row["choices"]["text"], row["choices"]["label"],
                                                                     strict=True)]
    return {"id": row["id"], "question": {"stem": row["question"], "choices": choices}, "answerKey": row["answerKey"]}


MBPP_SPLITS = ("prompt", "test", "validation", "train")
"""MBPP's splits in task-id order (1-10, 11-510, 511-600, 601-974): the folder's files hold all of them."""
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")

HUB_SOURCES = {
    "gsm8k/train.jsonl": HubSource("openai/gsm8k", ("main",), ("train",)),
    "gsm8k/test.jsonl": HubSource("openai/gsm8k", ("main",), ("test",)),
    "mbpp/mbpp.jsonl": HubSource("google-research-datasets/mbpp", ("full",), MBPP_SPLITS),
    "mbpp/sanitized-mbpp.jsonl": HubSource("google-research-datasets/mbpp", ("sanitized",), MBPP_SPLITS),
    "arc_challenge/ARC-Challenge-Train.jsonl": HubSource("allenai/ai2_arc", ("ARC-Challenge",), ("train",), arc_record),
    "arc_challenge/ARC-Challenge-Dev.jsonl": HubSource("allenai/ai2_arc", ("ARC-Challenge",), ("validation",),
                                                       arc_record),
    "arc_challenge/ARC-Challenge-Test.jsonl": HubSource("allenai/ai2_arc", ("ARC-Challenge",), ("test",), arc_record),
    "math500/test.jsonl": HubSource("HuggingFaceH4/MATH-500", (None,), ("test",)),
    "math/train.jsonl": HubSource("EleutherAI/hendrycks_math", MATH_SUBJECTS, ("train",)),
    "math/test.jsonl": HubSource("EleutherAI/hendrycks_math", MATH_SUBJECTS, ("test",)),
    "mmlu_pro/test.jsonl": HubSource("TIGER-Lab/MMLU-Pro", (None,), ("test",)),
    "mmlu_pro/validation.jsonl": HubSource("TIGER-Lab/MMLU-Pro", (None,), ("validation",)),
}
"""The hub data set of each file of the data folder that has one (HumanEval+ mini has none in its format)."""


# 1. the folders -----------------------------------------------------------------------------------------------

def default_data_dir() -> Path:
    """$REFUSION_DATA_DIR, else the first of ../shared/data from the working directory and ../shared/data next to
    the project root (the folder holding src/) that exists, else the latter."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    folders = local_folders()
    return next((folder for folder in folders if folder.is_dir()), folders[-1])


def local_folders() -> list[Path]:
    """The data folders looked in when none is named: ../shared/data from the working directory, then beside
    the project."""
    return [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2].parent / "shared" / "data"]


def hub_copy_dir() -> Path | None:
    """Where copies made from the hub are kept: `data/` in refusion's cache; None when the cache is off."""
    from refusion.cache_dirs import cache_root

    models = cache_root()
    return models.parent / "data" if models is not None else None


# 2. the hub -----------------------------------------------------------------------------------------------------

def hub_unavailable() -> str | None:
    """Why the hub cannot be used for data now (offline, `datasets` missing, no answer), or None when it can."""
    import importlib.util

    from refusion.hub import hub_reachable, offline_setting

    setting = offline_setting(OFFLINE_ENVS)
    if setting:
        return f"{setting} is set"
    if importlib.util.find_spec("datasets") is None:
        return "the datasets package is not installed: pip install 'refusion[data]'"
    return None if hub_reachable(HUB_TIMEOUT, OFFLINE_ENVS) else f"the hub did not answer within {HUB_TIMEOUT:g} s"


def download(relative: str, source: HubSource, target: Path) -> Path:
    """The rows of `source` converted to the folder's records, written to `target` (via a temporary file, so
    that an interrupted download leaves nothing under the file's name)."""
    from datasets import load_dataset

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            for config in source.configs:
                for split in source.splits:
                    for row in load_dataset(source.dataset, config, split=split):
                        f.write(json.dumps(source.to_record(row), ensure_ascii=False) + "\n")
        os.replace(partial, target)
    except Exception as e:  # a hub or conversion failure: one line, the file named
        partial.unlink(missing_ok=True)
        raise FileNotFoundError(f"{relative}: reading {source.dataset} from the hub failed "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return target


def _temporary_copy_dir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="refusion-data-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


# 3. finding a file ----------------------------------------------------------------------------------------------

def data_file(relative: str, data_dir: str | Path | None = None, *, needed_by: str = "") -> Path:
    """The path of the data folder's file `relative` ("gsm8k/test.jsonl"), found as the module docstring says;
    FileNotFoundError of one line when it is nowhere. `needed_by` opens the message ("task gsm8k")."""
    named = Path(data_dir) if data_dir is not None else (
        Path(os.environ[DATA_DIR_ENV]) if os.environ.get(DATA_DIR_ENV) else None)
    folders = [named] if named is not None else local_folders()
    copies = hub_copy_dir() if named is None else None
    for folder in [*folders, *([copies] if copies else [])]:
        if (folder / relative).is_file():
            return folder / relative
    if named is not None:
        raise FileNotFoundError(f"{needed_by + ' needs ' if needed_by else ''}{relative}, not found in {named}: "
                                f"{HOW_TO_PROVIDE.format(relative=relative)}")
    why_not = relative not in HUB_SOURCES and "not there in this format" or hub_unavailable()
    if why_not is None:
        return download(relative, HUB_SOURCES[relative], (copies or _temporary_copy_dir()) / relative)
    looked = " nor ".join(str(folder) for folder in dict.fromkeys([*folders, *([copies] if copies else [])]))
    raise FileNotFoundError(f"{needed_by + ' needs ' if needed_by else ''}{relative}, found neither in {looked} "
                            f"nor on the hub ({why_not}): {HOW_TO_PROVIDE.format(relative=relative)}")
