"""Bad input as a new user would try it: an unknown or unavailable --device is a one-line error; a response_format
schema of any size or depth is compiled within a bound or refused with a 400 (never a 500); bad requests sent while
another decodes leave it untouched."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from refusion.model.tiny import TINY_VOCAB, tiny_model, tiny_tokenizer

from .conftest import MODEL, LiveServer, live_server, make_app

pytest.importorskip("llguidance")


@pytest.mark.parametrize("device", ["foo", "cpu:x", "xla", "cuda", "cuda:99", "mps"])
def test_an_unknown_or_unavailable_device_is_a_one_line_error(device, capsys):
    import torch

    from refusion.serve import cli

    available = {"cuda": torch.cuda.is_available(), "cuda:99": False, "mps": torch.backends.mps.is_available()}
    if available.get(device):
        pytest.skip(f"this machine has {device}")
    assert cli.main(["--device", device, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"refusion serve: error: --device={device}") and "\n" not in err, err
    assert ("not a device" in err or "not supported" in err) if device in ("foo", "cpu:x", "xla") else \
        "not available on this machine" in err


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def any_of(depth: int, width: int) -> dict:
    """A schema whose grammar grows as width ** depth."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {f"k{j}": schema}} for j in range(width)]}
    return schema


def body(schema=None, raw_format=None, **kwargs) -> dict:
    response_format = raw_format or {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"model": MODEL, "messages": [{"role": "user", "content": "json"}], "max_tokens": 8,
            "response_format": response_format, "refusion": {"strategy": "autoregressive"}, **kwargs}


BAD = {  # name -> (body as text, what the 400 names)
    "nested 300 deep": (json.dumps(body(nested(300))), "nested more than"),
    "nested past the parser": ('{"model": "tiny", "messages": [], "response_format": ' + "[" * 50_000
                               + "]" * 50_000 + "}", "nested too deeply"),
    "nested in the schema past the parser": (json.dumps(body({"type": "string"}))[:-1].replace(
        '"schema": {"type": "string"}', '"schema": {"x": ' + "[" * 5000 + "]" * 5000 + "}"), "nested"),
    "20,000 properties": (json.dumps(body({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(20_000)}})), "bytes of JSON"),
    "exponential anyOf": (json.dumps(body(any_of(9, 3))), "bytes of JSON"),
    "1,000 optional properties": (json.dumps(body({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(1000)}})), "max is 2000"),
    "not a schema": (json.dumps(body({"type": "no-such-type"})), "response_format"),
    "an unknown $ref": (json.dumps(body({"$ref": "#/$defs/missing"})), "response_format"),
}


@pytest.fixture(scope="module")
def json_tiny():
    """The tiny model with a tokenizer that can spell JSON."""
    return tiny_model("qwen3", vocab_size=TINY_VOCAB + 4), tiny_tokenizer(extra_chars="{}[]")


def test_pathological_schemas_are_400s_and_leave_other_requests_alone(json_tiny):
    with LiveServer(make_app(json_tiny, max_batch_size=2)) as live:
        long = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                "refusion": {"strategy": "autoregressive", "ignore_eos": True}}
        alone = httpx.post(f"{live.url}/v1/chat/completions", json=long, timeout=60).json()
        result = {}
        other = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{live.url}/v1/chat/completions", json=long, timeout=60)))
        other.start()
        answers = {name: httpx.post(f"{live.url}/v1/chat/completions", content=text,
                                    headers={"Content-Type": "application/json"}, timeout=60)
                   for name, (text, _) in BAD.items()}
        other.join(60)
        for name, (_, says) in BAD.items():
            r = answers[name]
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            assert says in r.json()["error"]["message"], (name, r.json())
        # the request decoding meanwhile was not slowed into failure nor changed
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        status = live.wait_idle()
        assert status["failed"] == 0 and status["completed"] == 2


def test_a_large_schema_within_the_bounds_compiles(json_tiny):
    names = [f"p{i}" for i in range(1000)]
    wide = {"type": "object", "properties": {name: {"type": "integer"} for name in names}, "required": names}
    with LiveServer(make_app(json_tiny)) as live:
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body(wide), timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["message"]["content"].startswith('{"p0":')


def test_a_schema_the_tokenizer_cannot_spell_is_a_400(tiny):
    """The default tiny tokenizer has no '{': the grammar's first forced byte cannot be written."""
    with live_server(tiny) as live:
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body({"type": "object"}), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:300]
        assert "cannot follow this schema" in r.json()["error"]["message"]
        assert live.scheduler.status()["failed"] == 0
