"""Prefix caching through the server: requests sharing a system prompt and a chat's resent conversation answer as
without the cache, in every strategy, and the hit and query counters move."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL, live_server

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SYSTEM = "you are a helpful assistant. answer briefly and politely, in plain words."  # 4+ blocks of characters
STRATEGIES = [{}, {"strategy": "speculative", "draft_length": 3}, {"strategy": "autoregressive"}]


def counters(url: str) -> dict[str, float]:
    """The prefix cache's counters, under refusion's names and vLLM's."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if "prefix_cache" in s.name and s.name.endswith("_total")}


def ask(client, messages: list[dict], extra: dict):
    """(answer text, cached prompt tokens) of one chat completion; its usage reports them as OpenAI does."""
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                              extra_body={"refusion": extra})
    choice = response.choices[0]
    cached = choice.model_extra["refusion"].get("cached_prompt_tokens")
    assert response.usage.prompt_tokens_details.cached_tokens == (cached or 0)
    return choice.message.content, cached


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_requests_sharing_a_system_prompt_answer_as_without_the_cache(tiny):
    questions = ["what is a cat?", "name a colour.", "count to five."]
    with live_server(tiny, prefix_cache_mb=0) as plain:
        client = plain.client()
        expected = [[ask(client, conversation(q), extra)[0] for q in questions] for extra in STRATEGIES]
        assert set(counters(plain.url).values()) == {0.0}  # off: nothing looked up
    with live_server(tiny) as cached:
        client = cached.client()
        before = counters(cached.url)
        assert before["refusion_prefix_cache_queries_total"] == 0
        for extra, answers in zip(STRATEGIES, expected):
            got = [ask(client, conversation(q), extra) for q in questions]
            assert [text for text, _ in got] == answers
            assert all(hit >= 64 for _, hit in got[1:]), got  # the system prompt's blocks
        after = counters(cached.url)
    queries, hits = after["refusion_prefix_cache_queries_total"], after["refusion_prefix_cache_hits_total"]
    assert queries > hits >= 64 * (len(STRATEGIES) * len(questions) - 1)
    vllm = {name: v for name, v in after.items() if name.startswith("vllm:")}
    assert vllm == {"vllm:prefix_cache_queries_total": queries, "vllm:prefix_cache_hits_total": hits}


def test_a_chat_turn_reuses_the_conversation_it_resends(tiny):
    turns = ["hi there.", "tell me more.", "and then?"]

    def chat(server) -> list[tuple[str, int | None]]:
        client, messages, replies = server.client(), [], []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            text, cached = ask(client, messages, {})
            replies.append((text, cached))
            messages.append({"role": "assistant", "content": text})
        return replies

    with live_server(tiny, prefix_cache_mb=0) as plain:
        expected = chat(plain)
    with live_server(tiny) as cached:
        replies = chat(cached)
    assert [text for text, _ in replies] == [text for text, _ in expected]
    assert [hit for _, hit in expected] == [None] * 3
    assert replies[0][1] == 0 and all(hit >= 16 for _, hit in replies[1:]), replies
