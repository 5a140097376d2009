"""The OpenAI API with the official `openai` client against a live server on localhost (tiny random model)."""

from __future__ import annotations

import threading

import httpx
import pytest

import refusion
from refusion.config import DecodeConfig

from .conftest import MODEL

openai = pytest.importorskip("openai")

SERVER_DEFAULTS = dict(max_new_tokens=16, slot_size=4, block_size=8)


def chat(client, content="x", **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def stream_text(client, content="x", **kwargs):
    """(text, finish_reason, chunks) of a streamed chat completion."""
    chunks = list(chat(client, content, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks


def engine_text(tiny, content: str, **cfg) -> str:
    """What `refusion.generate` answers to one chat turn: the server must return exactly this."""
    model, tokenizer = tiny
    ids = refusion.encode_prompts(tokenizer, [content], chat=True)
    out = refusion.generate(model, ids, DecodeConfig(**{**SERVER_DEFAULTS, **cfg}))
    return tokenizer.decode(out.sequences[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_models_and_health(live, tiny):
    client = live.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    engine = client.models.retrieve(MODEL).model_extra["refusion"]  # what decodes, from the model itself
    model = tiny[0]
    assert engine == {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "device": "cpu",
                      "setup": refusion.setup_of(model).describe()}
    health = httpx.get(f"{live.url}/health").json()
    assert health["status"] == "ok" and health["running"] and health["max_batch_size"] == 4


def test_chat_equals_engine_with_usage_and_stats(live, tiny):
    response = chat(live.client(), "what is 2+2?")
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == engine_text(tiny, "what is 2+2?")
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 16
    prompt_tokens = len(refusion.encode_prompts(tiny[1], ["what is 2+2?"])[0])
    assert response.usage.prompt_tokens == prompt_tokens and response.usage.total_tokens == prompt_tokens + 16
    stats = choice.model_extra["refusion"]
    assert stats["strategy"] == "refusion" and stats["forwards"] >= 1 and stats["rounds"] >= 1


def test_stream_equals_non_stream_at_temperature_0(live):
    client = live.client()
    for kwargs in ({}, {"refusion": {"strategy": "autoregressive"}}, {"refusion": {"slot_size": 2, "block_size": 4}}):
        whole = chat(client, "tell me a story", max_tokens=12, extra_body=kwargs)
        text, finish, chunks = stream_text(client, "tell me a story", max_tokens=12, extra_body=kwargs,
                                           stream_options={"include_usage": True})
        assert text == whole.choices[0].message.content and finish == [whole.choices[0].finish_reason]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert len({c.id for c in chunks}) == 1


def test_request_overrides_server_defaults(live, tiny):
    client = live.client()
    ar = chat(client, "hello", extra_body={"refusion": {"strategy": "autoregressive"}})
    assert ar.choices[0].message.content == engine_text(tiny, "hello", strategy="autoregressive")
    assert ar.choices[0].model_extra["refusion"]["tokens_per_forward"] == pytest.approx(1.0)
    # the tiny model ends this answer with <|im_end|>: finish_reason "stop", the EOS is not in the text
    assert ar.choices[0].finish_reason == "stop" and ar.usage.completion_tokens < 16
    settings = {"slot_size": 2, "block_size": 2, "slot_threshold": 0.5, "token_threshold": 0.2}
    small = chat(client, "hello", max_tokens=10, extra_body={"refusion": settings})
    assert small.choices[0].message.content == engine_text(tiny, "hello", max_new_tokens=10, **settings)


def test_speculative_strategy_is_exact_streamed_or_not_with_phase_forwards(live, tiny):
    """strategy "speculative" answers exactly what AR decoding does; its stats say where the forwards went."""
    client = live.client()
    extra = {"refusion": {"strategy": "speculative", "draft_length": 3}}
    ar = engine_text(tiny, "hello", strategy="autoregressive")
    whole = chat(client, "hello", extra_body=extra)
    choice = whole.choices[0]
    assert choice.message.content == ar and choice.finish_reason == "stop"  # EOS, decided by the program
    stats = choice.model_extra["refusion"]
    assert stats["strategy"] == "speculative" and set(stats["committed_by"]) == {"speculative"}
    assert stats["phase_forwards"]["prefill"] == 1 and sum(stats["phase_forwards"].values()) == stats["forwards"]
    assert stats["drafted"] >= stats["accepted"] >= 0 and 0 <= stats["draft_acceptance"] <= 1
    text, finish, chunks = stream_text(client, "hello", extra_body=extra)
    assert (text, finish) == (ar, ["stop"])
    assert chunks[-1].choices[0].model_extra["refusion"]["phase_forwards"] == stats["phase_forwards"]
    long = chat(client, "tell me a story", max_tokens=12, extra_body=extra).choices[0]
    assert long.message.content == engine_text(tiny, "tell me a story", max_new_tokens=12, strategy="autoregressive")


def test_refusion_stats_have_phase_forwards(live):
    stats = chat(live.client(), "what is 2+2?").choices[0].model_extra["refusion"]
    assert stats["phase_forwards"]["plan"] >= 1 and sum(stats["phase_forwards"].values()) == stats["forwards"]
    assert set(stats["committed_by"]) <= {"fast_accept", "parallel_completion"} and "drafted" not in stats


def test_ignore_eos_decodes_max_tokens(live):
    response = chat(live.client(), "hello", max_tokens=24,
                    extra_body={"refusion": {"strategy": "autoregressive", "ignore_eos": True}})
    assert response.usage.completion_tokens == 24 and response.choices[0].finish_reason == "length"


def test_stop_string_cuts_stream_and_whole_alike(live):
    client = live.client()
    full = chat(client, "tell me a story", max_tokens=16).choices[0].message.content
    stop = full[5:7]
    expected = full[: full.index(stop)]
    whole = chat(client, "tell me a story", max_tokens=16, stop=[stop, "never-there"])
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (expected, "stop")
    text, finish, _ = stream_text(client, "tell me a story", max_tokens=16, stop=stop)
    assert (text, finish) == (expected, ["stop"])


@pytest.mark.parametrize("strategy", ["refusion", "speculative", "autoregressive"])
def test_seeded_sampling_is_reproducible_and_samples(live, strategy):
    client = live.client()
    extra = {"refusion": {"strategy": strategy}}

    def text(**kwargs):
        return chat(client, "x", max_tokens=12, extra_body=extra, **kwargs).choices[0].message.content

    greedy = text(temperature=0)
    sampled = {seed: text(temperature=1.0, seed=seed) for seed in range(4)}
    assert all(text(temperature=1.0, seed=seed) == sampled[seed] for seed in (0, 1))  # same seed, same text
    # temperature is honoured: the seeds do not all give the same text, and not all the greedy one
    assert len(set(sampled.values())) > 1 and any(t != greedy for t in sampled.values())


def test_completions_with_several_prompts_and_stream(live):
    client = live.client()
    whole = client.completions.create(model=MODEL, prompt=["ab", "what is"], max_tokens=8)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=MODEL, prompt=["ab", "what is"], max_tokens=8, stream=True))
    for i in range(2):
        text = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        assert text == whole.choices[i].text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4)
    assert ids.usage.prompt_tokens == 3


def test_concurrent_requests_are_batched_and_equal_to_single(live):
    client = live.client()
    prompts = ["a", "bb", "what is 2+2?", "hello there", "tell me", "xyz"]
    alone = {p: chat(client, p, max_tokens=12).choices[0].message.content for p in prompts[:2]}
    steps_before = live.scheduler.status()["steps"]
    results, errors = {}, []

    def ask(p):
        try:
            response = chat(client, p, max_tokens=12)
            results[p] = (response.choices[0].message.content, response.choices[0].model_extra["refusion"])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == len(prompts)
    assert all(results[p][0] == alone[p] for p in alone)  # batched == single
    steps = live.scheduler.status()["steps"] - steps_before
    assert steps < sum(stats["forwards"] for _, stats in results.values())  # forwards were shared
    assert live.wait_idle()["live"] == 0


BAD = [  # (path, raw body, status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}', 400,
     "messages.0.role"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
     400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
     400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30}',
     400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"max_tokens": 100000000000000000000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"max_completion_tokens": -1}', 400, "max_completion_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}',
     400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
     400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}',
     400, "temperature"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0.9}',
     400, "top_p"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}', 400, "n"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 13}', 400,
     "n"),  # more choices than max_batch_size + max_queue of the test server (4 + 8)
    ("/v1/completions", b'{"model": "tiny", "prompt": ["a", "b", "c"], "n": 5}', 400, "n"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
     400, "stream"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "best_model": 1}',
     400, "best_model"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"refusion": {"slot_size": 3}}', 400, "refusion.block_size"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"refusion": {"slot_threshold": 2}}', 400, "refusion.slot_threshold"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"refusion": {"strategy": "beam"}}', 400, "refusion.strategy"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["", "a"]}',
     400, "stop"),
    ("/v1/chat/completions", b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2, 999]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "echo": true}', 400, "echo"),
    ("/v1/nowhere", b"{}", 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_with_an_openai_error_body(live, path, body, status, param):
    before = live.scheduler.status()
    response = httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["param"] == param and error["message"]
    if param is not None and status == 400:  # the message names the field (as the client sent it)
        assert param.split(".")[-1] in error["message"] or param.split(".")[0] in error["message"], error
    if status == 404 and param == "model":
        assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    if body[:1] != b"{" or body == b"{not json":
        assert "JSON" in error["message"]
    after = live.scheduler.status()  # nothing was queued or decoded for a bad request
    assert (after["completed"], after["steps"]) == (before["completed"], before["steps"])


def test_openai_client_raises_typed_errors_and_server_stays_healthy(live):
    client = live.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="block_size"):
        chat(client, extra_body={"refusion": {"slot_size": 16}})
    with pytest.raises(openai.BadRequestError, match="top_p"):
        chat(client, top_p=0.5)
    assert chat(client, max_tokens=4).usage.completion_tokens == 4
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
