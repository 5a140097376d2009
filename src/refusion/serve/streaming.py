"""Relaying a request's scheduler events to its client: `Reply` builds the OpenAI response objects (chat or text
completion, whole or chunked); `collect` gathers the events into one response, `stream` sends them as
server-sent events. Both end when the client disconnects (`events` polls for it), and the caller then cancels
the request's jobs, which frees their batch rows."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from refusion.serve.errors import ApiError
from refusion.serve.metrics import RequestTimer
from refusion.serve.scheduler import DECODING_FAILED, SHUTTING_DOWN, Event, Job, PublishedLogprob
from refusion.serve.schemas import error_body, new_id, now
from refusion.serve.server import Server

ERROR_STATUS = {DECODING_FAILED: 500, SHUTTING_DOWN: 503}
"""HTTP status of an error event, by its code."""
CLIENT_CLOSED_REQUEST = 499
"""Status recorded (and, for a non-streamed request, answered) when the client left first (nginx's code)."""
DISCONNECT_POLL_SECONDS = 0.25
REQUEST_TIMEOUT = "request_timeout"
"""Error code of a request that outlived the server's --request-timeout (answered 504)."""


class Reply:
    """Builds the response objects (chat or text completion, whole or chunked)."""

    def __init__(self, server: Server, body, prompts: list[list[int]], chat: bool):
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created, self.model, self.chat = now(), server.model_name, chat
        self.prompt_tokens = sum(map(len, prompts))
        self.include_usage = body.include_usage()
        self.logprobs = body.logprobs_wanted() is not None

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        """OpenAI's usage object; `cached_tokens`: prompt tokens read from the prefix cache (vLLM and OpenAI report
        them in `prompt_tokens_details`)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def choice(self, index: int, text: str, event: Event | None, logprobs: list[PublishedLogprob]) -> dict:
        finish = event.finish_reason if event else None
        choice = {"index": index, "logprobs": self.logprobs_object(logprobs), "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        if event is not None and event.stats is not None:
            choice["refusion"] = event.stats
        return choice

    def whole(self, choices: list[dict], completion_tokens: int, cached_tokens: int) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices,
                "usage": self.usage(completion_tokens, cached_tokens)}

    def logprobs_object(self, logprobs: list[PublishedLogprob] | None) -> dict | None:
        """OpenAI's logprobs of a choice or chunk: chat `{"content": [...], "refusal": None}`, completions
        `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; None when the request asked for none."""
        if not self.logprobs:
            return None
        logprobs = logprobs or []
        if self.chat:
            def entry(token: str, logprob: float) -> dict:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs], "refusal": None}
        return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [dict(lp.top) for lp in logprobs], "text_offset": [lp.offset for lp in logprobs]}

    def chunk(self, index: int, text: str | None, event: Event | None = None, role: bool = False) -> dict:
        carried = event.logprobs if event is not None and text is not None else None  # a delta's own tokens
        choice = {"index": index, "logprobs": self.logprobs_object(carried) if carried else None,
                  "finish_reason": event.finish_reason if event else None}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if role else
                               {} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        if event is not None and event.stats is not None:
            choice["refusion"] = event.stats
        return self._chunk([choice])

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {**self._chunk([]), "usage": self.usage(completion_tokens, cached_tokens)}

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}


async def events(request: Request, queue: asyncio.Queue, deadline: float | None = None
                 ) -> AsyncIterator[tuple[int, Event]]:
    """The jobs' events as they come; ends when the client has disconnected (checked every
    DISCONNECT_POLL_SECONDS whether events flow or not), so a client that leaves before its first chunk, or
    an ASGI server that drops writes to a closed connection, never keeps a sequence decoding. Past `deadline`
    (the event loop's clock) it raises a 504 `request_timeout`."""
    next_check = loop_time() + DISCONNECT_POLL_SECONDS
    while True:
        wait = DISCONNECT_POLL_SECONDS if deadline is None else max(min(DISCONNECT_POLL_SECONDS,
                                                                        deadline - loop_time()), 0)
        try:
            item = await asyncio.wait_for(queue.get(), wait)
        except asyncio.TimeoutError:
            item = None
        if item is None and deadline is not None and loop_time() >= deadline:
            raise timed_out()
        if loop_time() >= next_check:
            next_check = loop_time() + DISCONNECT_POLL_SECONDS
            if await request.is_disconnected():
                return
        if item is not None:
            yield item


def timed_out() -> ApiError:
    return ApiError(504, "the request did not finish within the server's request timeout (--request-timeout); "
                         "its decoding was stopped", code=REQUEST_TIMEOUT)


async def collect(request: Request, jobs: list[Job], queue: asyncio.Queue, reply: Reply,
                  deadline: float | None = None) -> JSONResponse:
    """Non-streamed: gather every job's deltas until its final event (or until the client leaves, or `deadline`
    passes: a 504)."""
    texts, finals = [""] * len(jobs), [None] * len(jobs)
    logprobs: list[list[PublishedLogprob]] = [[] for _ in jobs]
    async with contextlib.aclosing(events(request, queue, deadline)) as stream:
        async for index, event in stream:
            if event.error is not None:
                raise ApiError(ERROR_STATUS.get(event.code, 500), event.error, code=event.code or DECODING_FAILED)
            texts[index] += event.delta
            logprobs[index] += event.logprobs or []
            if event.final:
                finals[index] = event
            if all(f is not None for f in finals):
                break
        else:
            return JSONResponse(error_body("client disconnected"), status_code=CLIENT_CLOSED_REQUEST)
    choices = [reply.choice(i, texts[i], finals[i], logprobs[i]) for i in range(len(jobs))]
    return JSONResponse(reply.whole(choices, sum(f.completion_tokens for f in finals),
                                    sum(f.cached_prompt_tokens for f in finals)))


async def stream(server: Server, request: Request, jobs: list[Job], queue: asyncio.Queue,
                 reply: Reply, timer: RequestTimer, deadline: float | None = None) -> AsyncIterator[str]:
    """Streamed: one SSE chunk per delta, a last chunk per choice with its finish_reason, then [DONE]. An error
    (decoding failed, server shutting down, `deadline` passed) is an `{"error": ...}` event, then [DONE].

    When the client disconnects, the server cancels this generator (ASGI spec < 2.4) or `events` ends
    (any server); `finally` frees the jobs' rows.
    """
    status = CLIENT_CLOSED_REQUEST  # until the stream ends otherwise
    try:
        if reply.chat:
            for i in range(len(jobs)):
                yield sse(reply.chunk(i, None, role=True))
        done, completion_tokens, cached_tokens = 0, 0, 0
        try:
            async with contextlib.aclosing(events(request, queue, deadline)) as relayed:
                async for index, event in relayed:
                    if event.error is not None:
                        status = ERROR_STATUS.get(event.code, 500)
                        yield sse(error_body(event.error, type="server_error", code=event.code or DECODING_FAILED))
                        break
                    if event.delta or event.logprobs:
                        yield sse(reply.chunk(index, event.delta, event))
                    if event.final:
                        done += 1
                        completion_tokens += event.completion_tokens
                        cached_tokens += event.cached_prompt_tokens
                        yield sse(reply.chunk(index, None, event))
                    if done == len(jobs):
                        if reply.include_usage:
                            yield sse(reply.usage_chunk(completion_tokens, cached_tokens))
                        status = 200
                        break
                else:
                    return  # the client has gone
        except ApiError as e:  # the deadline passed
            status = e.status
            yield sse(error_body(e.message, type="server_error", code=e.code))
        yield "data: [DONE]\n\n"
    finally:
        timer.finish(status)
        for job in jobs:
            server.scheduler.cancel(job)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
