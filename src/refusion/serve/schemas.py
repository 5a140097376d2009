"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests follow the OpenAI names (`max_tokens`, `temperature`, `stop`, `seed`, `stream`, `n`, ...). Fields the
decoder has no use for are accepted only at their neutral value (`top_p=1`, penalties 0, ...), so a
client never silently gets something other than what it asked for; any other unknown field is a 400,
as with the OpenAI API. ReFusion settings go in the extension object `"refusion": {...}`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, model_validator

from refusion.config import (
    MAX_TOP_LOGPROBS,
    MODEL_FIELDS,
    OPENAI_NAMES,
    DecodeConfig,
    field_docs,
    field_types,
)

MAX_TOKENS_LIMIT = 1 << 20
"""Upper bound of `max_tokens` checked before tokenization; the model's context is checked after."""
MAX_CHOICES = 16
"""Upper bound of `n` (choices per prompt); each choice is its own sequence in the batch."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")




class _RefusionOptionsBase(_Strict):
    ignore_eos: StrictBool = Field(False, description="decode exactly max_tokens tokens (benchmarks)")

    def overrides(self) -> dict:
        """DecodeConfig fields this request sets."""
        return {k: v for k, v in self.model_dump(exclude={"ignore_eos"}).items() if v is not None}


def _decode_option_fields() -> dict:
    """One optional field per DecodeConfig field (type and description from the dataclass), less the ones with a
    standard OpenAI name and the model's token ids. DecodeConfig validates the values (400 naming the field)."""
    docs, types = field_docs(DecodeConfig), field_types(DecodeConfig)
    fields = {}
    for f in dataclasses.fields(DecodeConfig):
        if f.name in OPENAI_NAMES or f.name in MODEL_FIELDS:
            continue
        kind = StrictBool if types[f.name] is bool else types[f.name]
        fields[f.name] = (kind | None, Field(None, description=docs.get(f.name)))
    return fields


RefusionOptions = create_model(
    "RefusionOptions", __base__=_RefusionOptionsBase, __module__=__name__,
    __doc__="Per-request decoding settings (the extension object `\"refusion\"`): every DecodeConfig field but "
            "the standard OpenAI ones and the model's token ids; unset fields keep the server's.",
    **_decode_option_fields())


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    """Send a last chunk with `usage` (and no choices) before `[DONE]`."""


def only(*values) -> dict:
    """The OpenAPI schema of a field the server accepts at these values only (what the validators enforce)."""
    return {"json_schema_extra": {"enum": [*values, None]}}


NEUTRAL = {"top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
"""The only value of each sampling field the decoder does not implement."""


class _Neutral(_Strict):
    """Standard OpenAI fields the decoder does not implement: accepted only at their neutral value."""

    top_p: float | None = Field(None, description="nucleus sampling; only 1 (the decoder samples the full softmax)",
                                **only(NEUTRAL["top_p"]))
    frequency_penalty: float | None = Field(None, description="only 0", **only(NEUTRAL["frequency_penalty"]))
    presence_penalty: float | None = Field(None, description="only 0", **only(NEUTRAL["presence_penalty"]))
    logit_bias: dict[str, float] | None = Field(None, description="only empty", json_schema_extra={"maxProperties": 0})
    user: str | None = Field(None, description="end-user id (ignored)")

    @model_validator(mode="after")
    def _only_neutral(self):
        for name, value in NEUTRAL.items():
            got = getattr(self, name)
            if got is not None and got != value:
                raise UnsupportedValue(name, f"{name}={got!r} is not supported by the ReFusion decoder: "
                                             f"leave it out or set it to {value!r}")
        if self.logit_bias:
            raise UnsupportedValue("logit_bias", "logit_bias is not supported by the ReFusion decoder")
        return self


class UnsupportedValue(ValueError):
    """A known field at a value the server does not implement (reported as a 400 naming the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict = Field(alias="schema", description="the JSON schema the response follows")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise UnsupportedValue("response_format", "response_format needs json_schema exactly when its type is "
                                                      "\"json_schema\"")
        return self

    def as_dict(self) -> dict:
        """The engine's response_format (`refusion.generate`)."""
        if self.json_schema is None:
            return {"type": self.type}
        return {"type": self.type, "json_schema": {"name": self.json_schema.name, "schema": self.json_schema.schema_}}


class _Generation(_Neutral):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT, description="most tokens to generate")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy")
    seed: int | None = Field(None, description="seed for sampling (temperature > 0); choice i uses seed + i")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices per prompt, each decoded as its own "
                          "sequence (identical at temperature 0)")
    stop: str | list[str] | None = Field(None, description="up to 4 strings that end the text (not included)")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    refusion: RefusionOptions | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = self.stop_strings()
        if len(stops) > 4 or any(not s for s in stops):
            raise UnsupportedValue("stop", "stop must be a non-empty string or a list of at most 4 of them")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def choices_per_prompt(self) -> int:
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # `name`, `refusal`, ... pass through to the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT, description="alias of max_tokens")
    logprobs: StrictBool | None = Field(None, description="return each content token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: also the most "
                                     "likely tokens at each position, this many")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def logprobs_wanted(self) -> int | None:
        """DecodeConfig.logprobs of this request: None (off), else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict]:
        """Messages for the chat template: plain role/content dicts (`developer` is a system turn)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: StrictBool | None = Field(None, description="only false", **only(False))
    best_of: int | None = Field(None, description="only 1", **only(1))
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="return each token's "
                                 "log-probability and the most likely tokens at each position, this many")
    suffix: str | None = Field(None, description="only null", **only())

    @model_validator(mode="after")
    def _neutral_completion_fields(self):
        for name, ok in (("echo", not self.echo), ("best_of", self.best_of in (None, 1)),
                         ("suffix", self.suffix is None)):
            if not ok:
                raise UnsupportedValue(name, f"{name} is not supported by the ReFusion server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise UnsupportedValue("prompt", "prompt is an empty list")
        return self

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        """DecodeConfig.logprobs of this request: None (off), else how many alternatives per token."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ------------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
