"""Logprobs through the OpenAI API, read by the official `openai` client (tiny random model)."""

from __future__ import annotations

import math

import httpx
import pytest

import refusion
from refusion.config import DecodeConfig

from .conftest import MODEL

openai = pytest.importorskip("openai")

SERVER_DEFAULTS = dict(max_new_tokens=16, slot_size=4, block_size=8)
STRATEGIES = [{}, {"strategy": "speculative"}, {"strategy": "autoregressive"}]


def chat(client, content="x", **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def engine_logprobs(tiny, content: str, top: int, **cfg) -> list[float]:
    """The logprobs `refusion.generate` gives one chat turn's tokens (EOS left out, as the server does)."""
    model, tokenizer = tiny
    ids = refusion.encode_prompts(tokenizer, [content], chat=True)
    cfg = DecodeConfig(**SERVER_DEFAULTS, logprobs=top).for_strategy(cfg.get("strategy", "refusion"))
    out = refusion.generate(model, ids, cfg)
    eos = set(refusion.setup_of(model).special_tokens.eos_token_ids)
    return [lp.logprob for lp in out.logprobs[0] if lp.token not in eos]


@pytest.mark.parametrize("settings", STRATEGIES, ids=lambda s: s.get("strategy", "refusion"))
def test_chat_logprobs_equal_the_engines_and_stream_equals_whole(live, tiny, settings):
    client = live.client()
    whole = chat(client, "tell me a story", logprobs=True, top_logprobs=3, extra_body={"refusion": settings})
    content = whole.choices[0].logprobs.content
    assert content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert [t.logprob for t in content] == pytest.approx(engine_logprobs(tiny, "tell me a story", 3, **settings),
                                                         abs=1e-5)
    for t in content:
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6
        assert bytes(t.bytes) == t.token.encode()

    chunks = list(chat(client, "tell me a story", logprobs=True, top_logprobs=3, stream=True,
                       extra_body={"refusion": settings}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    for c in chunks:  # a chunk carries the logprobs of the tokens whose text it carries
        if c.choices and c.choices[0].logprobs:
            assert "".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content


def test_chat_without_top_logprobs_and_off_by_default(live):
    client = live.client()
    response = chat(client, "hi", max_tokens=6, logprobs=True)
    assert all(t.top_logprobs == [] for t in response.choices[0].logprobs.content)
    assert chat(client, "hi", max_tokens=6).choices[0].logprobs is None


def test_completions_logprobs_in_openais_shape(live):
    response = live.client().completions.create(model=MODEL, prompt="once upon a time", max_tokens=8, logprobs=2,
                                                extra_body={"refusion": {"strategy": "speculative"}})
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert math.isfinite(logprob) and 1 <= len(top) <= 2 and token in top
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the token is the most likely one


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(live, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{live.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
