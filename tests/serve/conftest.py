"""A live server on an ephemeral localhost port (uvicorn in a thread) serving the tiny random model."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

MODEL = "tiny"


class LiveServer:
    """The server of `refusion serve` (uvicorn + drain on shutdown) running `app` in a background thread; `url`,
    `client()`, `scheduler`; `server.begin_shutdown()` does what SIGTERM does."""

    def __init__(self, app, grace: float = 5.0):
        import uvicorn

        from refusion.serve.shutdown import GracefulServer

        self.app = app
        self.scheduler = app.state.server.scheduler
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = GracefulServer(config, self.scheduler, grace=grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.scheduler.resume()
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not shut down"

    def client(self, **kwargs):
        kwargs.setdefault("timeout", 30)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Wait until no sequence is live or waiting; return the scheduler status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.scheduler.status()
            if status["live"] == 0 and status["waiting"] == 0:
                return status
            time.sleep(0.02)
        raise AssertionError(f"the scheduler is still busy: {self.scheduler.status()}")


@pytest.fixture(scope="package", autouse=True)
def server_cpu_threads():
    """One core fewer than the machine has (`refusion serve --threads`): these servers share their process with the
    test's clients, and with every core spinning torch workers each forward of the tiny model was 100x slower."""
    import os

    import torch

    from refusion.cpu import choose_cpu_threads

    saved = torch.get_num_threads()
    choose_cpu_threads(max(1, (os.cpu_count() or 2) - 1))
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny():
    from refusion.model.kernels.extension import native_extension
    from refusion.model.tiny import tiny_model, tiny_tokenizer

    native_extension()  # built here on first use (a minute on a busy machine), not inside a server's start deadline
    return tiny_model(), tiny_tokenizer()


def make_app(tiny, **kwargs):
    from refusion.config import DecodeConfig
    from refusion.serve.app import create_app

    kwargs.setdefault("config", DecodeConfig(max_new_tokens=16, slot_size=4, block_size=8))
    kwargs.setdefault("max_batch_size", 4)
    kwargs.setdefault("max_queue", 8)
    return create_app(*tiny, model_name=MODEL, **kwargs)


@pytest.fixture(scope="module")
def live(tiny):
    with LiveServer(make_app(tiny)) as server:
        yield server


@contextlib.contextmanager
def live_server(tiny, grace: float = 5.0, **kwargs):
    with LiveServer(make_app(tiny, **kwargs), grace=grace) as server:
        yield server
