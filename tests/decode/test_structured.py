"""Structured output (`generate(..., response_format=...)`) on a tiny random model, whose free text is garbage: the
grammar alone makes it parse. The exact mode must commit constrained AR decoding's tokens."""

import json

import pytest

import refusion
from refusion.model.tiny import TINY_VOCAB, tiny_model, tiny_tokenizer

pytest.importorskip("llguidance")

JSON_CHARS = "{}[]"  # what JSON needs beyond the tiny tokenizer's characters
SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "sizes": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     "required": ["color", "sizes"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]
TEXTS = ["hello there", "what is 2+2?", "x", "give me json", "a b c d e f"]


@pytest.fixture(scope="module")
def tiny_json():
    model = tiny_model("qwen3", vocab_size=TINY_VOCAB + len(JSON_CHARS))
    return model, tiny_tokenizer(extra_chars=JSON_CHARS)


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "test", "schema": schema}}


def validate(instance, schema: dict) -> None:
    try:
        import jsonschema_rs
    except ImportError:  # by hand: the structure of the schemas above
        kind = schema["type"]
        assert isinstance(instance, {"object": dict, "array": list}[kind])
        if kind == "object":
            assert set(instance) == set(schema["required"])
        return
    jsonschema_rs.validate(schema, instance)


def decode(tiny, texts, response_format, **settings):
    model, tokenizer = tiny
    prompts = [tokenizer.encode(t) for t in texts]
    cfg = refusion.DecodeConfig(**{"max_new_tokens": 48, "eos_token_id": 2, **settings})
    return prompts, refusion.generate(model, prompts, cfg, response_format=response_format, tokenizer=tokenizer)


def texts_of(tiny, out) -> list[str]:
    return [tiny[1].decode(s, skip_special_tokens=True) for s in out.sequences]


@pytest.mark.parametrize("strategy", ["autoregressive", "speculative"])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum-array", "array"])
def test_every_response_that_ends_parses_and_validates(tiny_json, strategy, schema):
    for temperature in (0.0, 1.0):
        _, out = decode(tiny_json, TEXTS, json_schema(schema), strategy=strategy, temperature=temperature, seed=1)
        ended = [text for text, s in zip(texts_of(tiny_json, out), out.stats.per_sequence) if s.finish_reason == "eos"]
        assert ended, "no response completed its grammar"
        for text in ended:
            validate(json.loads(text), schema)


def test_json_object_responses_are_objects(tiny_json):
    _, out = decode(tiny_json, TEXTS, {"type": "json_object"}, strategy="autoregressive", max_new_tokens=24)
    for text, stats in zip(texts_of(tiny_json, out), out.stats.per_sequence):
        assert text.startswith("{")
        if stats.finish_reason == "eos":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("settings", [dict(draft_length=3), dict(draft_length=2, predraft=True),
                                      dict(draft_length=2, lookup_length=4)],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("schema", SCHEMAS[:2], ids=["object", "enum-array"])
def test_exact_mode_is_token_identical_to_constrained_autoregressive(tiny_json, settings, schema):
    prompts, ar = decode(tiny_json, TEXTS, json_schema(schema), strategy="autoregressive")
    _, exact = decode(tiny_json, TEXTS, json_schema(schema), strategy="speculative", **settings)
    assert exact.sequences == ar.sequences
    # prompts that hold the answer: prompt lookup drafts it, the verification accepts it under the grammar
    model, tokenizer = tiny_json
    echoing = [p + s for p, s in zip(prompts, ar.sequences)]
    cfg = refusion.DecodeConfig(max_new_tokens=48, eos_token_id=2)
    ar2 = refusion.generate(model, echoing, cfg.replace(strategy="autoregressive"), response_format=json_schema(schema),
                            tokenizer=tokenizer)
    exact2 = refusion.generate(model, echoing, cfg.replace(strategy="speculative", **settings),
                               response_format=json_schema(schema), tokenizer=tokenizer)
    assert exact2.sequences == ar2.sequences
    if settings.get("lookup_length"):
        assert sum(s.accepted for s in exact2.stats.per_sequence) > 0


def test_plan_and_infill_is_refused_naming_the_strategy(tiny_json):
    with pytest.raises(ValueError, match="strategy 'refusion'"):
        decode(tiny_json, TEXTS[:1], {"type": "json_object"}, strategy="refusion")


def test_response_format_needs_the_tokenizer_and_a_known_type(tiny_json):
    model, tokenizer = tiny_json
    with pytest.raises(ValueError, match="tokenizer"):
        refusion.generate(model, [[5, 6]], strategy="autoregressive", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="type must be one of"):
        refusion.generate(model, [[5, 6]], strategy="autoregressive", response_format={"type": "xml"},
                          tokenizer=tokenizer)
    text = refusion.generate(model, [[5, 6]], strategy="autoregressive", max_new_tokens=4,
                             response_format={"type": "text"}, tokenizer=tokenizer)
    assert text.sequences == refusion.generate(model, [[5, 6]], strategy="autoregressive", max_new_tokens=4).sequences
