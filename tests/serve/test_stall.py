"""The scheduler's stall detection (`Scheduler.stalled_for`), which the replicas' health check reads: a decoder
whose step never returns while it has work is stalled; an idle, paused or stepping one is not."""

from __future__ import annotations

import threading
import time

import pytest

from refusion.config import DecodeConfig
from refusion.serve.scheduler import Event, Job, Scheduler

from .test_faults import wait_for


def job(tokenizer, events: list[Event]) -> Job:
    config = DecodeConfig(max_new_tokens=8, strategy="autoregressive")
    return Job(prompt=tokenizer.encode("hello"), config=config, mask_token_id=tokenizer.mask_token_id,
               eos_token_ids=[tokenizer.eos_token_id], emit=events.append)


def wedge(scheduler: Scheduler) -> tuple[threading.Event, threading.Event]:
    """The next step blocks until released (a forward that hangs); returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    step = scheduler.decoder.step

    def wedged_step(**kwargs):
        entered.set()
        release.wait(30)
        return step(**kwargs)

    scheduler.decoder.step = wedged_step
    return entered, release


def test_a_wedged_step_with_work_is_stalled_and_an_idle_or_paused_scheduler_is_not(tiny):
    model, tokenizer = tiny
    scheduler = Scheduler(model, tokenizer, max_batch_size=2, max_queue=2)
    scheduler.start()
    try:
        time.sleep(0.3)  # idle for a while: an old heartbeat is no stall without work
        assert scheduler.stalled_for() == 0.0

        entered, release = wedge(scheduler)
        events: list[Event] = []
        scheduler.submit([job(tokenizer, events)])
        assert entered.wait(10)
        time.sleep(0.3)
        assert scheduler.stalled_for() >= 0.3  # live work, no step finished
        assert scheduler.running  # the thread is alive: only the stall tells this decoder is wedged

        release.set()
        wait_for(lambda: events and events[-1].final, timeout=30)
        assert events[-1].error is None and scheduler.stalled_for() == 0.0  # finished and idle again

        scheduler.pause()  # paused on purpose with work waiting: not a stall
        scheduler.submit([job(tokenizer, events)])
        time.sleep(0.3)
        assert scheduler.busy and scheduler.stalled_for() == 0.0
        scheduler.resume()
        wait_for(lambda: not scheduler.busy, timeout=30)
    finally:
        scheduler.stop()


def test_the_scheduler_thread_builds_its_decoder_and_runs_every_step(tiny, monkeypatch):
    """One thread computes (`refusion.cpu`): the decoder's cache is made on the scheduler thread, which steps it."""
    import threading

    from refusion.decode import loop

    model, tokenizer = tiny
    threads: set[str] = set()
    build, step = loop.Decoder.__init__, loop.Decoder.step

    def recorded(method):
        def run(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return method(self, *args, **kwargs)
        return run

    monkeypatch.setattr(loop.Decoder, "__init__", recorded(build))
    monkeypatch.setattr(loop.Decoder, "step", recorded(step))
    scheduler = Scheduler(model, tokenizer, max_batch_size=2, max_queue=2)
    scheduler.start()
    try:
        events: list[Event] = []
        scheduler.submit([job(tokenizer, events)])
        wait_for(lambda: events and events[-1].final, timeout=30)
        assert events[-1].error is None
    finally:
        scheduler.stop()
    assert threads == {"refusion-scheduler"}


def test_a_decoder_that_cannot_be_built_fails_start(tiny, monkeypatch):
    from refusion.decode import loop

    def refuse(self, *args, **kwargs):
        raise ValueError("prefix caching is off for this model: a reason")

    monkeypatch.setattr(loop.Decoder, "__init__", refuse)
    scheduler = Scheduler(*tiny, max_batch_size=2, max_queue=2)
    with pytest.raises(ValueError, match="prefix caching is off"):
        scheduler.start()
    assert not scheduler.running
