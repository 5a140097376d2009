"""Fixtures shared by every test folder."""

import os

import pytest

from refusion.model.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 model and its character tokenizer, saved as a Hugging Face directory."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def model_cache_in_tmp(tmp_path_factory):
    """Models that refusion.load builds are cached in a temporary directory, never in the user's cache
    (subprocesses started by tests inherit it)."""
    saved = os.environ.get("REFUSION_CACHE")
    os.environ["REFUSION_CACHE"] = str(tmp_path_factory.mktemp("refusion-cache"))
    yield
    if saved is None:
        del os.environ["REFUSION_CACHE"]
    else:
        os.environ["REFUSION_CACHE"] = saved
