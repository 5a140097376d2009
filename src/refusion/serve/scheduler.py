"""The scheduler: one thread owns the `Decoder` and runs continuous (dynamic) batching.

Request handlers `submit` jobs to a bounded waiting queue. The scheduler thread loops:

1. admit waiting jobs into the batch (up to `max_batch_size` live sequences) and drop cancelled ones;
2. run one batched forward (`Decoder.step`) for every live sequence;
3. publish: for every sequence whose committed contiguous prefix grew, decode it to text, cut it at a
   stop string, and send the new text to the job's handler; finished, stopped and cancelled sequences
   leave the batch (their cache rows are freed at once).

Events reach the handlers through `Job.emit`, which must not block (the app hands it an asyncio queue
via `loop.call_soon_threadsafe`), so a slow reader never holds up the batch. Streamed and non-streamed
requests run the same code: a non-streamed response is the concatenation of the streamed deltas.

Faults stay with their sequence: a sequence whose program raises, or whose text cannot be published, fails
alone (an error event) while the rest of the batch goes on; only a failing batched forward fails every live
sequence (the decoder is then rebuilt). `drain(grace)` is the clean shutdown: no new jobs, the accepted ones
finish within `grace` seconds, the rest end with a "shutting_down" error event.

The loop beats a heartbeat each time it wakes with work and after each step: `stalled_for()` is how long it has
gone without one while it has work, so a health check tells a wedged decoder (a forward that never returns) from
a busy one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from refusion.config import DecodeConfig
from refusion.decode.stream import TextStream

if TYPE_CHECKING:
    from refusion.decode.prefix_cache import PrefixCache
    from refusion.decode.sequence import Sequence

log = logging.getLogger("refusion.serve")


@dataclass(frozen=True)
class PublishedLogprob:
    """One published token's log-probability, as text (what the API's logprobs objects are built from)."""

    token: str
    """The token's text."""
    logprob: float
    top: list[tuple[str, float]]
    """(text, log-probability) of the most likely tokens at its position, most likely first."""
    offset: int
    """Where the token's text starts in the choice's text."""


@dataclass
class Event:
    """What a job's handler receives: text, then one final event (finish_reason or error)."""

    delta: str = ""
    """New text (appended to everything sent before)."""
    logprobs: list[PublishedLogprob] | None = None
    """When the job asks for logprobs: those of the tokens whose text `delta` completes (EOS tokens left out)."""
    finish_reason: str | None = None
    """"stop" (EOS or a stop string), "length" (max_tokens), "cancelled"; None while decoding goes on."""
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Final event: the prompt tokens whose KV entries came from the prefix cache (0 without one)."""
    stats: dict | None = None
    """Decoder statistics of the finished sequence (forwards, rounds, tokens_per_forward, phase_forwards, ...)."""
    error: str | None = None
    """Set when decoding failed or was cut short by shutdown; the event is final."""
    code: str | None = None
    """With `error`: "decoding_failed" (answered 500) or "shutting_down" (503)."""

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class Job:
    """One prompt to decode (a request with several prompts submits several jobs)."""

    prompt: list[int]
    config: DecodeConfig
    mask_token_id: int | None
    eos_token_ids: list[int]
    emit: Callable[[Event], None]
    """Called from the scheduler thread with each event; must not block."""
    stops: list[str] = field(default_factory=list)
    generator: torch.Generator | None = None
    """None: the decoder makes the sequence's own (seeded with config.seed + index at temperature > 0)."""
    index: int = 0
    """Position of the prompt in its request (its seed offset)."""
    grammar: object | None = None
    """The response's structured-output grammar (`refusion.decode.grammar.ResponseGrammar`), or None."""
    submitted: float = field(default_factory=time.perf_counter)
    # scheduler state
    seq: Sequence | None = None
    admitted: float = 0.0
    first_token_at: float | None = None
    """When its first response token was committed in the contiguous prefix (perf_counter)."""
    abort: str | None = None
    """Why the server cut this job short (shutdown); it then ends with an error event, not "cancelled"."""
    rounds_seen: int = -1
    tokens: int = 0
    logprobs_sent: int = 0
    """Response tokens whose logprobs were published (the text of each lies within what was sent)."""
    cancelled: bool = False
    done: bool = False
    text: TextStream = field(init=False)

    def __post_init__(self):
        self.text = TextStream(self.stops)


class QueueFull(RuntimeError):
    """The waiting queue is full (the server answers 503)."""


class SchedulerStopped(RuntimeError):
    """The scheduler is not running (the server answers 503)."""


class Draining(SchedulerStopped):
    """The server is shutting down and admits no new job (the server answers 503)."""


DECODER_CAPACITY = 512
"""Cache columns the scheduler's decoder starts with (it grows, and compacts, as prompts come and go)."""
SHUTTING_DOWN = "shutting_down"
DECODING_FAILED = "decoding_failed"


class SchedulerObserver:
    """What the scheduler thread reports (the server's metrics implement it); every hook must be quick."""

    def sequence_admitted(self, job: Job) -> None:
        """A job joined the batch (its prompt is about to be prefilled)."""

    def first_token(self, job: Job) -> None:
        """A job's first response token was committed in its contiguous prefix (`job.first_token_at`)."""

    def sequence_left(self, job: Job, outcome: str) -> None:
        """A job left the batch: outcome "completed", "cancelled" or "failed" (`job.seq` may be None when it
        failed to start)."""


class Scheduler:
    """Owns a `Decoder` in a dedicated thread; see the module docstring."""

    def __init__(self, model, tokenizer, *, max_batch_size: int = 8, max_queue: int = 64,
                 decoder_capacity: int = DECODER_CAPACITY, observer: SchedulerObserver | None = None,
                 prefix_cache: PrefixCache | None = None):
        """`prefix_cache`: where prompt prefixes' KV entries are kept across requests (`decode.prefix_cache`; it
        outlives a decoder rebuilt after a failed step); None: every prompt is prefilled whole."""
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 and max_queue={max_queue} >= 0")
        self.model, self.tokenizer = model, tokenizer
        self.observer = observer or SchedulerObserver()
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.decoder_capacity = decoder_capacity
        self.prefix_cache = prefix_cache
        self.decoder = None
        self.waiting: deque[Job] = deque()
        self.live: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False
        self._abort: str | None = None
        self._admitting = 0
        """Jobs taken from the queue and not yet in `live` (the scheduler thread admits them outside the lock)."""
        self._paused = False
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        """When the loop last showed progress: woke with work, or finished a step (monotonic)."""
        self._sleeping = False
        """Whether the loop waits for work (then it cannot be stalled)."""
        self.tokenizer_lock = threading.Lock()
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "aborted": 0, "steps": 0}

    # ----------------------------------------------------------------------------- handler side
    def start(self) -> None:
        """Start the scheduler thread; it builds the decoder (its cache) and runs every forward, so that this process
        computes on one long-lived thread (`refusion.cpu`: other threads' OpenMP workers slow it). Raises what
        building the decoder raised."""
        self.model.eval()
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="refusion-scheduler", daemon=True)
        self._thread.start()
        built.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; jobs still waiting or live get an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def capacity(self) -> int:
        """Most jobs one submission can ever hold: a batch of rows plus a full queue."""
        return self.max_batch_size + self.max_queue

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs (all or none); raise QueueFull when they do not fit, Draining once `drain` has begun."""
        with self._cond:
            if self._draining:
                raise Draining("the server is shutting down and accepts no new requests")
            if not self.running:
                raise SchedulerStopped("the decoding scheduler is not running")
            free_rows = 0 if self._paused else max(self.max_batch_size - len(self.live), 0)
            if len(self.waiting) + len(jobs) > self.max_queue + free_rows:
                self.counters["rejected"] += 1
                raise QueueFull(f"the server is busy: {len(self.live)} requests decoding and {len(self.waiting)} "
                                f"waiting (max_queue={self.max_queue}); retry later")
            self.waiting.extend(jobs)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client went away: forget a waiting job, or free a live job's row before the next step."""
        with self._cond:
            if job.cancelled or job.done:
                return
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
                self.counters["cancelled"] += 1
            self._cond.notify_all()

    def drain(self, grace: float) -> int:
        """Clean shutdown, blocking: admit no new job, let the accepted ones (live and waiting) finish for up
        to `grace` seconds, then end the rest with a "shutting_down" error. Returns how many were cut."""
        with self._cond:
            self._draining = True
        deadline = time.monotonic() + grace
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        cut = self.abort_all(f"the server shut down before this request finished (grace period {grace:g} s)")
        deadline = time.monotonic() + 10  # the aborted live jobs leave at the scheduler's next iteration
        while self.live and self.running and time.monotonic() < deadline:
            time.sleep(0.02)
        return cut

    def abort_all(self, message: str) -> int:
        """End every accepted job with an error event `message` (code "shutting_down"): waiting jobs at once,
        live ones before the next step (the scheduler thread marks them). Returns how many."""
        with self._cond:
            waiting, live = list(self.waiting), len(self.live)
            self.waiting.clear()
            self._draining, self._abort = True, message
            self.counters["aborted"] += len(waiting)
            self._cond.notify_all()
        for job in waiting:
            job.done = True
            job.emit(Event(error=message, code=SHUTTING_DOWN))
        return len(waiting) + live

    @property
    def busy(self) -> bool:
        """Whether any job is waiting, being admitted or decoding."""
        return bool(self.waiting or self._admitting or self.live)

    @property
    def draining(self) -> bool:
        return self._draining

    def pause(self) -> None:
        """Stop admitting and stepping (live sequences wait, new ones queue): for maintenance and tests."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stalled_for(self) -> float:
        """Seconds the loop has gone without progress while it has work: 0 when it is idle, paused or stepping on
        time; growing while a step never returns (a wedged forward or lock). Read from any thread, lock-free, so
        that a health check never waits on the thread it checks."""
        if self._sleeping or self._paused or not self.busy or not self.running:
            return 0.0
        return max(time.monotonic() - self._heartbeat, 0.0)

    def held_tokens(self) -> int:
        """Tokens the running sequences hold in the KV cache: their prompts and the response tokens committed in
        order so far (read from any thread; an estimate between two steps)."""
        return sum(len(job.prompt) + job.tokens for job in list(self.live))

    def status(self) -> dict:
        return {"running": self.running, "draining": self._draining, "live": len(self.live), "waiting": len(self.waiting),
                "max_batch_size": self.max_batch_size, "max_queue": self.max_queue, **self.counters}

    # ----------------------------------------------------------------------------- scheduler thread
    def _new_decoder(self):
        from refusion.decode.loop import Decoder
        return Decoder(self.model, capacity=self.decoder_capacity, prefix_cache=self.prefix_cache)

    def _run(self, built: concurrent.futures.Future) -> None:
        try:
            self.decoder = self._new_decoder()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            while True:
                try:
                    if not self._iterate():
                        break
                except Exception as e:  # a failed forward (or a bug) must not take the server down
                    log.exception("decoding step failed")
                    self._fail_all(f"decoding failed: {type(e).__name__}: {e}")
        finally:
            for job in [*self.live, *self.waiting]:
                job.done = True
                job.emit(Event(error="the server is shutting down", code=SHUTTING_DOWN))
            self.live.clear()
            self.waiting.clear()

    def _iterate(self) -> bool:
        # 1. admit new jobs, drop cancelled ones
        with self._cond:
            while self._idle():
                self._sleeping = True
                self._cond.wait()
            self._sleeping = False
            self._heartbeat = time.monotonic()
            if self._stopping:
                return False
            admitted = []
            while not self._paused and self.waiting and len(self.live) + len(admitted) < self.max_batch_size:
                admitted.append(self.waiting.popleft())
            self._admitting = len(admitted)
        for job in admitted:
            self._admit(job)
        self._admitting = 0
        if self._abort is not None:
            for job in self.live:
                job.abort, job.cancelled = job.abort or self._abort, True
        for job in [j for j in self.live if j.cancelled]:
            if job.abort is not None:
                self._leave(job, Event(error=job.abort, code=SHUTTING_DOWN, completion_tokens=job.tokens))
            else:
                self._leave(job, Event(finish_reason="cancelled", completion_tokens=job.tokens))
        if self._paused or not self.live:
            return True

        # 2. one batched forward for every live sequence; a sequence whose program raises fails alone
        failed: list[tuple[Sequence, Exception]] = []
        finished = {seq.id for seq in self.decoder.step(on_error=lambda seq, e: failed.append((seq, e)))}
        self.counters["steps"] += 1
        self._heartbeat = time.monotonic()
        for seq, e in failed:
            job = next(j for j in self.live if j.seq is seq)
            log.error("decoding failed for one sequence", exc_info=e)
            self._fail(job, f"decoding failed: {type(e).__name__}: {e}")

        # 3. publish the text that became contiguous, finish what ended
        for job in list(self.live):
            try:
                self._publish(job, job.seq.id in finished)
            except Exception as e:
                log.exception("publishing a sequence's text failed")
                self.decoder.cancel(job.seq)
                self._fail(job, f"decoding failed: {type(e).__name__}: {e}")
        return True

    def _idle(self) -> bool:
        """Nothing to do until a handler calls in (holding the lock)."""
        if self._stopping or any(j.cancelled for j in self.live) or (self._abort is not None and self.live):
            return False
        return self._paused or (not self.waiting and not self.live)

    def _admit(self, job: Job) -> None:
        try:
            job.seq = self.decoder.add(job.prompt, job.config, mask_token_id=job.mask_token_id,
                                       eos_token_ids=job.eos_token_ids, generator=job.generator, index=job.index,
                                       grammar=job.grammar)
        except Exception as e:
            log.exception("could not start a sequence")
            self._fail(job, f"could not start decoding: {type(e).__name__}: {e}")
            return
        job.admitted = time.perf_counter()
        self.live.append(job)
        self.observer.sequence_admitted(job)

    def _publish(self, job: Job, finished: bool) -> None:
        seq = job.seq
        if not finished and seq.stats.rounds == job.rounds_seen:
            return  # nothing was committed since the last look
        job.rounds_seen = seq.stats.rounds
        tokens = seq.response() if finished else seq.contiguous_response()
        if len(tokens) == job.tokens and not finished:
            return
        job.tokens = len(tokens)
        if job.first_token_at is None and tokens:
            job.first_token_at = time.perf_counter()
            self.observer.first_token(job)
        with self.tokenizer_lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        delta, stopped = job.text.update(text, final=finished)
        logprobs = self._new_logprobs(job, tokens) if job.config.logprobs is not None else None
        if delta or logprobs:
            job.emit(Event(delta=delta, logprobs=logprobs))
        if stopped or finished:
            # the program decided why it ended ("eos" or "length"); OpenAI calls an EOS a "stop"
            reason = "stop" if stopped or seq.stats.finish_reason == "eos" else "length"
            self._leave(job, Event(finish_reason=reason, completion_tokens=len(tokens),
                                   cached_prompt_tokens=seq.stats.cached_tokens or 0, stats=self._stats(job)))

    def _new_logprobs(self, job: Job, tokens: list[int]) -> list[PublishedLogprob]:
        """The logprobs of the tokens whose text now lies within the text sent (a token cut by a stop string, or
        whose text is held back, waits or is never published), EOS tokens left out. Decodes one prefix per token:
        only requests that ask for logprobs pay for it."""
        start, sent = job.logprobs_sent, len(job.text.sent)
        with self.tokenizer_lock:
            ends = []
            while start + len(ends) < len(tokens):
                end = len(self.tokenizer.decode(tokens[: start + len(ends) + 1], skip_special_tokens=True,
                                                clean_up_tokenization_spaces=False))
                if end > sent:
                    break
                ends.append(end)
            if not ends:
                return []
            begin = len(self.tokenizer.decode(tokens[:start], skip_special_tokens=True,
                                              clean_up_tokenization_spaces=False)) if start else 0
            offsets = [begin, *ends[:-1]]
            records = job.seq.response_logprobs(start, start + len(ends))
            eos = set(job.eos_token_ids)
            published = [PublishedLogprob(self._token_text(r.token), r.logprob,
                                          [(self._token_text(t), lp) for t, lp in r.top], offset)
                         for r, offset in zip(records, offsets) if r.token not in eos]
        job.logprobs_sent = start + len(ends)
        return published

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _leave(self, job: Job, event: Event) -> None:
        """Take a job out of the batch (freeing its cache row) and send its final event. Counted first: whoever
        reads `status()` and sees the job gone sees its outcome."""
        outcome = "completed" if event.error is None and event.finish_reason != "cancelled" else "cancelled"
        self.counters["aborted" if event.error is not None else outcome] += 1
        if job in self.live:
            self.live.remove(job)
            try:
                self.decoder.cancel(job.seq)  # a no-op for a sequence that finished
            except Exception:
                log.exception("closing a cancelled sequence failed (its row is freed)")
        job.done = True
        self.observer.sequence_left(job, outcome)
        job.emit(event)

    def _fail(self, job: Job, message: str) -> None:
        """End one job with a "decoding_failed" error (its sequence already left the decoder)."""
        self.counters["failed"] += 1  # counted first, as in _leave
        if job in self.live:
            self.live.remove(job)
        job.done = True
        self.observer.sequence_left(job, "failed")
        job.emit(Event(error=message, code=DECODING_FAILED, completion_tokens=job.tokens))

    def _stats(self, job: Job) -> dict:
        s = job.seq.stats
        stats = {"strategy": job.config.strategy, "tokens": s.tokens, "forwards": s.forwards, "rounds": s.rounds,
                 "tokens_per_forward": job.tokens / s.forwards if s.forwards else 0.0,
                 "phase_forwards": dict(s.phase_forwards), "committed_by": dict(s.committed_by)}
        if s.cached_tokens is not None:
            stats["cached_prompt_tokens"] = s.cached_tokens
        if s.drafted:
            stats.update(drafted=s.drafted, accepted=s.accepted, draft_acceptance=s.accepted / s.drafted)
        stats.update(queue_seconds=job.admitted - job.submitted, decode_seconds=time.perf_counter() - job.admitted,
                     seconds=s.seconds, finish_reason=s.finish_reason)
        return stats

    def _fail_all(self, message: str) -> None:
        """After a failed step: fail every live job and start over with a fresh decoder."""
        for job in list(self.live):
            self._fail(job, message)
        self.decoder = self._new_decoder()
