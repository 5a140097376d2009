"""benchmarks/serving.py's clients against a live server: a level counts the prompt tokens the server read from its
prompt cache, so a comparison can show that neither server had one (or what each took from it)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from .conftest import MODEL, live_server

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


@pytest.fixture(scope="module")
def serving(tiny):
    if str(BENCHMARK.parent) not in sys.path:  # as `python benchmarks/serving.py` runs it: its folder's harness
        sys.path.insert(0, str(BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("serving_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SERVED_NAME = MODEL  # the test server's name
    return module


def level(serving, url: str, prompts: list[str], requests: int) -> dict:
    return asyncio.run(serving.run_level(url, prompts, 1, requests, 8, {}))


def test_a_level_counts_the_prompt_tokens_read_from_the_servers_cache(serving, tiny):
    prompt = "tell me about the weather in a few words, please, and then about the sea."
    with live_server(tiny) as cached:
        first = level(serving, cached.url, [prompt], 1)
        again = level(serving, cached.url, [prompt], 2)  # the same prompt twice more: its blocks are cached
    assert first["cached_prompt_tokens"] == 0 and first["prompt_tokens"] > 16
    assert again["prompt_tokens"] == 2 * first["prompt_tokens"]
    assert 16 <= again["cached_prompt_tokens"] < again["prompt_tokens"]  # the last token is always prefilled
    with live_server(tiny, prefix_cache_mb=0) as plain:  # as the levels run it: every prompt prefilled in full
        uncached = level(serving, plain.url, [prompt], 3)
    assert uncached["cached_prompt_tokens"] == 0 and uncached["prompt_tokens"] == 3 * first["prompt_tokens"]
    assert uncached["tokens"] == first["tokens"] + again["tokens"]  # the cache changes no answer
