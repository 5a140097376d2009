"""Fixtures shared by every test folder."""

import contextlib
from pathlib import Path

import pytest

from refusion.decode.cache import CHECK_ENV
from refusion.model.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 model and its character tokenizer, saved as a Hugging Face directory."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


SAMPLE_DATA_DIR = Path(__file__).parent / "fixtures" / "data"
"""A few rows of each built-in data file, in the data folder's layout (tests/fixtures/data/README.md)."""


@pytest.fixture(scope="session")
def sample_data_dir() -> Path:
    """A data folder of a few real rows per file: what the tests of built-in tasks and sets read, so that they
    run on a fresh clone with no data folder beside it."""
    return SAMPLE_DATA_DIR


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """The environment variables `values` set (subprocesses started meanwhile inherit them), then restored: what the
    session fixtures below set for every test."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="session", autouse=True)
def the_cache_checks_its_invariant():
    """Every cache checks its invariant on every commit in the tests (off by default: `cache.checks_by_default`),
    in the processes they start too."""
    with environment({CHECK_ENV: "1"}):
        yield


@pytest.fixture(scope="session", autouse=True)
def data_never_from_the_hub():
    """No test downloads a data set: a data file missing from the folders is an error, not a download
    (subprocesses started by tests inherit it)."""
    with environment({"HF_DATASETS_OFFLINE": "1"}):
        yield


@pytest.fixture(scope="session", autouse=True)
def model_cache_in_tmp(tmp_path_factory):
    """Models that refusion.load builds are cached in a temporary directory, never in the user's cache
    (subprocesses started by tests inherit it)."""
    with environment({"REFUSION_CACHE": str(tmp_path_factory.mktemp("refusion-cache"))}):
        yield


def engine_processes(root: Path) -> list:
    """The resident engine processes (`refusion.engine`) whose directory lies under `root`."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info.get("status") == psutil.STATUS_ZOMBIE:
            continue  # exited (its parent, gone, left it for init to reap)
        cmdline = process.info.get("cmdline") or []
        if "refusion.engine.process" in cmdline and any(arg.startswith(str(root)) for arg in cmdline):
            found.append(process)
    return found


@pytest.fixture(scope="session", autouse=True)
def engines_in_tmp(tmp_path_factory):
    """Commands decode in their own process unless a test asks for the resident engine (REFUSION_KEEP_ALIVE=0
    here; tests/engine/ set a keep-alive); engines live in a temporary directory, and none outlives the session:
    one left running fails the run (after it is killed)."""
    from refusion.engine.place import DIR_ENV, KEEP_ALIVE_ENV

    root = tmp_path_factory.mktemp("engines")
    with environment({DIR_ENV: str(root / "default"), KEEP_ALIVE_ENV: "0"}):
        yield root
    leftovers = engine_processes(tmp_path_factory.getbasetemp())  # the engine tests' directories included
    for process in leftovers:
        process.kill()
    assert not leftovers, f"tests left {len(leftovers)} resident engine(s) running: {leftovers}"
