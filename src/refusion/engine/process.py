"""The engine process: `refusion serve`'s app for each resident model, behind one unix socket.

    python -m refusion.engine.process --dir DIR [--keep-alive SECONDS] [--max-models 1]

`client.connect` starts it; nobody needs to by hand. What it serves:

- `GET /engine/status`: its identity (`place.identity`), process id and the resident models;
- `POST /engine/load {"spec", "keep_alive"}`: load a model (once, however many ask together) and return its card;
- `POST /engine/stop`: refuse new answers, finish the running ones, exit;
- every other path: the OpenAI API of the model named by the `X-Refusion-Load` header (`client.LOAD_HEADER`),
  served by that model's own `serve.app.create_app` (its scheduler, decoder and metrics).

A model stays resident until its keep-alive passes with nothing running on it; at most `--max-models` are resident,
the least recently used unloaded first (after its running answers). With no model left the process exits and removes
its socket. Connections from another user are closed unanswered (the directory is owner-only anyway: `place.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from refusion.cpu import choose_cpu_threads, passing_thread
from refusion.engine.client import KEEP_ALIVE_HEADER, LOAD_HEADER
from refusion.engine.place import SOCKET, identity

log = logging.getLogger("refusion.engine")

REAP_SECONDS = 0.5
"""How often the engine looks for models whose keep-alive has passed."""
UNLOAD_GRACE_SECONDS = 600.0
"""Longest wait for a model's running answers when it is unloaded to make room."""


@dataclass
class Resident:
    """One loaded model and the app that serves it."""

    key: str
    spec: dict
    app: object
    """Its `create_app` FastAPI app (the scheduler thread already running)."""
    loaded_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float = 300.0
    """Seconds it stays after its last answer (the latest request's keep-alive)."""
    active: int = 0
    """Requests being answered now."""

    @property
    def scheduler(self):
        return self.app.state.server.scheduler

    def idle_seconds(self, now: float) -> float:
        return 0.0 if self.active or self.scheduler.busy else now - self.last_used

    def card(self, strategy: str | None = None) -> dict:
        """What a command prints and needs of the model: its setup line (for `strategy`: whether its drafts are
        priced), the decoding defaults it is served with, whether it has a chat template."""
        from refusion.config import DecodeConfig
        from refusion.decode.cli import setup_line

        server = self.app.state.server
        setup = setup_line(server.model, DecodeConfig(strategy=strategy or server.config.strategy))
        return {"key": self.key, "spec": self.spec, "setup": setup, "dtype": server.engine["dtype"],
                "device": server.engine["device"], "defaults": server.config.to_dict(),
                "chat_template": bool(getattr(server.tokenizer, "chat_template", None)),
                "context_length": server.context_length}


def spec_key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def load_resident(spec: dict) -> Resident:
    """(a passing thread: `refusion.cpu`) Load the model of `spec` and start its app's scheduler, with the decoding
    defaults a command uses for it: the embedded model's preset when no model is named
    (`arguments.decode_config_from_args`)."""
    from refusion.arguments import check_device
    from refusion.config import DecodeConfig
    from refusion.model.embedded import default_decode_settings_or_none
    from refusion.serve.app import create_app
    from refusion.serve.replicas import LoadSpec

    load = LoadSpec(**spec)
    check_device(load.device)
    model, tokenizer = load.load()
    defaults = default_decode_settings_or_none() if load.model is None else None
    config = DecodeConfig(**defaults) if defaults else DecodeConfig()
    app = create_app(model, tokenizer, config=config, model_name="refusion")
    app.state.server.scheduler.start()
    return Resident(spec_key(spec), spec, app)


class Engine:
    """The resident models and the engine's own lifetime."""

    def __init__(self, keep_alive: float, max_models: int):
        self.models: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self.lock = asyncio.Lock()
        self.keep_alive, self.max_models = keep_alive, max_models
        self.last_activity = time.monotonic()
        self.loading = False
        self.stopping = False
        self.server = None  # the uvicorn server, to end it

    # -------------------------------------------------------------- models
    async def resident(self, spec: dict, keep_alive: float) -> Resident:
        """The model of `spec`, loaded if it is not resident (one load at a time: requests arriving together for the
        same model wait for the same load)."""
        key = spec_key(spec)
        async with self.lock:
            if key not in self.models:
                await self._make_room()
                self.loading = True
                try:
                    log.info("loading %s", key)
                    self.models[key] = await asyncio.wrap_future(passing_thread(load_resident, spec))
                finally:
                    self.loading = False
            resident = self.models[key]
            self.models.move_to_end(key)
        resident.keep_alive = keep_alive
        resident.last_used = self.last_activity = time.monotonic()
        return resident

    async def _make_room(self) -> None:
        while len(self.models) >= self.max_models:
            _, oldest = next(iter(self.models.items()))
            await self.unload(oldest, "to make room for another model")

    async def unload(self, resident: Resident, why: str) -> None:
        """Finish the model's running answers, stop its scheduler, free it."""
        log.info("unloading %s (%s)", resident.key, why)
        self.models.pop(resident.key, None)
        await asyncio.to_thread(resident.scheduler.drain, UNLOAD_GRACE_SECONDS)
        resident.scheduler.stop()
        del resident
        gc.collect()

    async def reap(self) -> None:
        """Unload the models whose keep-alive has passed; end the engine when it holds none and has been idle for
        its own keep-alive (or was asked to stop and has finished its answers)."""
        while True:
            await asyncio.sleep(REAP_SECONDS)
            now = time.monotonic()
            async with self.lock:
                for resident in list(self.models.values()):
                    if resident.idle_seconds(now) > resident.keep_alive:
                        await self.unload(resident, f"idle for {resident.keep_alive:g} s")
            busy = self.loading or any(r.active or r.scheduler.busy for r in self.models.values())
            if self.stopping and not busy:
                self.exit("asked to stop")
                return
            if not self.models and not busy and now - self.last_activity > self.keep_alive:
                self.exit(f"no model resident and idle for {self.keep_alive:g} s")
                return

    def exit(self, why: str) -> None:
        log.info("engine exiting: %s", why)
        if self.server is not None:
            self.server.should_exit = True

    def shutdown(self) -> None:
        for resident in self.models.values():
            resident.scheduler.stop()
        self.models.clear()

    def status(self) -> dict:
        now = time.monotonic()
        return {"identity": identity(), "pid": os.getpid(), "stopping": self.stopping, "loading": self.loading,
                "models": [{"key": r.key, "spec": r.spec, "loaded_seconds": now - r.loaded_at,
                            "idle_seconds": r.idle_seconds(now), "keep_alive": r.keep_alive, "active": r.active,
                            "setup": r.app.state.server.engine["setup"]} for r in reversed(self.models.values())]}


def control_app(engine: Engine):
    """The engine's own endpoints (module docstring)."""
    app = FastAPI(title="refusion engine", openapi_url=None)

    @app.get("/engine/status")
    async def status():
        return engine.status()

    @app.post("/engine/load")
    async def load(request: Request):
        body = await request.json()
        if engine.stopping:
            return stopping_response()
        try:
            resident = await engine.resident(body["spec"], float(body.get("keep_alive", engine.keep_alive)))
        except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
            return JSONResponse(error(str(e)), status_code=400)
        return resident.card(body.get("strategy"))

    @app.post("/engine/stop")
    async def stop():
        engine.stopping = True
        return {"stopping": True, "active": sum(r.active for r in engine.models.values())}

    return app


def error(message: str, code: str = "engine_error") -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def stopping_response():
    return JSONResponse(error("the engine is stopping: run the command again", "engine_stopping"), status_code=503)


class Router:
    """The ASGI app: the engine's endpoints, or the app of the model a request names."""

    def __init__(self, engine: Engine):
        self.engine, self.control = engine, control_app(engine)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http" or scope["path"].startswith("/engine/"):
            return await self.control(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        spec_text = headers.get(LOAD_HEADER.lower())
        if self.engine.stopping or spec_text is None:
            response = stopping_response() if self.engine.stopping else JSONResponse(
                error(f"the request names no model (header {LOAD_HEADER})"), status_code=400)
            return await response(scope, receive, send)
        keep_alive = float(headers.get(KEEP_ALIVE_HEADER.lower(), self.engine.keep_alive))
        try:
            resident = await self.engine.resident(json.loads(spec_text), keep_alive)
        except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
            return await JSONResponse(error(str(e)), status_code=400)(scope, receive, send)
        resident.active += 1
        try:
            await resident.app(scope, receive, send)
        finally:
            resident.active -= 1
            resident.last_used = self.engine.last_activity = time.monotonic()

    async def lifespan(self, receive, send):
        reaper = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                reaper = asyncio.create_task(self.engine.reap())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if reaper is not None:
                    reaper.cancel()
                await asyncio.to_thread(self.engine.shutdown)
                await send({"type": "lifespan.shutdown.complete"})
                return


def owner_only_protocol(allowed_uid: int):
    """uvicorn's HTTP protocol, closing every connection whose peer is not `allowed_uid` (SO_PEERCRED)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class OwnerOnly(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is None or peer_uid(sock) != allowed_uid:
                log.warning("refused a connection from another user")
                transport.close()

    return OwnerOnly


def peer_uid(sock) -> int | None:
    """The user id of the process at the other end of a unix socket (Linux SO_PEERCRED), None where unknown."""
    import struct

    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", creds)[1]


def listen(directory: Path) -> socket.socket:
    """The engine's socket, readable and writable by its owner only."""
    path = directory / SOCKET
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refusion.engine.process")
    parser.add_argument("--dir", required=True, type=Path, help="the engine's directory (owner-only)")
    parser.add_argument("--keep-alive", type=float, default=300.0, help="seconds idle without a model before exiting")
    parser.add_argument("--max-models", type=int, default=int(os.environ.get("REFUSION_MAX_MODELS", "1")),
                        help="most models resident at once (the least recently used is unloaded first)")
    parser.add_argument("--allowed-uid", type=int, default=os.getuid(), help="the one user served")
    args = parser.parse_args(argv)
    choose_cpu_threads()  # before torch loads: the same thread count as an in-process command
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from refusion.cli import quiet_libraries

    quiet_libraries()
    import uvicorn

    engine = Engine(args.keep_alive, max(args.max_models, 1))
    sock = listen(args.dir)
    inode = os.stat(args.dir / SOCKET).st_ino
    config = uvicorn.Config(Router(engine), fd=sock.fileno(), http=owner_only_protocol(args.allowed_uid),
                            log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    engine.server = uvicorn.Server(config)
    try:
        engine.server.run()
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(args.dir / SOCKET).st_ino == inode:  # not a newer engine's socket
                (args.dir / SOCKET).unlink()
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
