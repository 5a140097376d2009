"""response_format through the OpenAI API, with the official `openai` client (a tiny random model whose tokenizer
can spell JSON)."""

from __future__ import annotations

import json

import pytest

from refusion.config import DecodeConfig
from refusion.model.tiny import TINY_VOCAB, tiny_model, tiny_tokenizer

from .conftest import MODEL, LiveServer, make_app

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def json_server():
    tiny = tiny_model("qwen3", vocab_size=TINY_VOCAB + 4), tiny_tokenizer(extra_chars="{}[]")
    config = DecodeConfig(max_new_tokens=32, strategy="speculative", draft_length=2)
    with LiveServer(make_app(tiny, config=config)) as server:
        yield server


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                          **kwargs)


@pytest.mark.parametrize("strategy", ["speculative", "autoregressive"])
def test_json_schema_responses_parse_and_equal_streamed(json_server, strategy):
    client = json_server.client()
    extra = {"refusion": {"strategy": strategy}}
    whole = chat(client, response_format=FORMAT, extra_body=extra)
    assert whole.choices[0].finish_reason == "stop"
    answer = json.loads(whole.choices[0].message.content)
    assert set(answer) == {"n", "ok"} and isinstance(answer["n"], int) and isinstance(answer["ok"], bool)
    chunks = list(chat(client, response_format=FORMAT, extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_json_object_and_completions(json_server):
    client = json_server.client()
    response = chat(client, response_format={"type": "json_object"}, max_tokens=8)
    assert response.choices[0].message.content.startswith("{")
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=32,
                                           extra_body={"response_format": FORMAT})
    assert set(json.loads(completion.choices[0].text)) == {"n", "ok"}


def test_plan_and_infill_and_bad_formats_are_400s(json_server):
    client = json_server.client()
    with pytest.raises(openai.BadRequestError, match="strategy 'refusion'") as e:
        chat(client, response_format=FORMAT, extra_body={"refusion": {"strategy": "refusion"}})
    assert e.value.body["param"] == "refusion.strategy"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format"
