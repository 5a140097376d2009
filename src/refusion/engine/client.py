"""The command's side of the resident engine: find it, start it when it is not up, and talk to it.

HTTP over the engine's unix socket with the standard library (`http.client`), nothing else: a command that finds
the engine up imports neither torch nor transformers (tests/engine/test_imports.py), so it starts in a few tens of
milliseconds. Every failure is an `EngineUnavailable` with one line saying what happened; the command then decodes
in-process, as it would with `--keep-alive 0`.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from refusion.engine.place import LOG, SOCKET, START_LOCK, engine_dir, identity

START_SECONDS = 180.0
"""Longest wait for a starting engine to answer (it imports torch and the server: seconds on an idle machine,
much more on a loaded one)."""
STOP_SECONDS = 120.0
"""Longest wait for an engine asked to stop to finish its running answers and go."""
STATUS_SECONDS = 5.0
"""An engine that accepts a connection but does not answer its status within this is wedged."""
LOAD_SECONDS = 900.0
"""Longest wait for a model to load (a first load builds the model cache and the native layers: minutes)."""
LOG_LIMIT = 1 << 20
"""The engine's log is started afresh at a start once it holds more than this many bytes."""
LOAD_HEADER = "X-Refusion-Load"
"""Request header naming the model (a `load_spec` as JSON) that a generation request is for."""
KEEP_ALIVE_HEADER = "X-Refusion-Keep-Alive"
"""Request header: seconds the engine keeps that model after this request."""


class EngineUnavailable(RuntimeError):
    """The engine could not be reached, started or used; the message is one line for the user."""


class EngineRefused(EngineUnavailable):
    """The engine answered the request with an error (a model it cannot load, settings it refuses, ...)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code
        """The error code it answered with (e.g. "context_length_exceeded"), when it gave one."""


class EngineDied(EngineUnavailable):
    """The engine went away in the middle of an answer."""


class UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over a unix socket."""

    def __init__(self, path: Path, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Engine:
    """A running engine, reached through the socket in `directory`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.socket = directory / SOCKET

    # ------------------------------------------------------------------ plain requests
    def call(self, method: str, url: str, body: dict | None = None, timeout: float | None = STATUS_SECONDS) -> dict:
        """One request and its JSON answer; an error answer is an EngineUnavailable carrying its message."""
        connection = UnixConnection(self.socket, timeout)
        try:
            connection.request(method, url, body=None if body is None else json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        except (TimeoutError, ConnectionError, FileNotFoundError, http.client.HTTPException) as e:
            raise EngineUnavailable(f"the engine at {self.socket} did not answer ({_reason(e)})") from None
        finally:
            connection.close()
        answer = _json(payload)
        if response.status >= 400:
            raise EngineRefused(error_message(answer, response.status), error_code(answer))
        return answer

    def status(self) -> dict | None:
        """The engine's status, or None when no engine listens on the socket (none, or a stale socket file)."""
        try:
            return self.call("GET", "/engine/status")
        except EngineUnavailable:
            if not self.answers():
                return None
            raise

    def answers(self) -> bool:
        """Whether something accepts connections on the socket."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(STATUS_SECONDS)
            try:
                sock.connect(str(self.socket))
            except OSError:
                return False
        return True

    def load(self, spec: dict, keep_alive: float, strategy: str | None = None) -> dict:
        """Load the model of `spec` (once, whoever asks at the same time) and return its card: the setup line (for
        `strategy`), the decoding defaults the engine serves it with, whether it has a chat template."""
        return self.call("POST", "/engine/load", {"spec": spec, "keep_alive": keep_alive, "strategy": strategy},
                         timeout=LOAD_SECONDS)

    def stop(self) -> dict:
        return self.call("POST", "/engine/stop", {})

    def wait_gone(self, timeout: float = STOP_SECONDS, pid: int | None = None) -> None:
        """Wait until nothing answers on the socket (and process `pid`, when given, has exited)."""
        deadline = time.monotonic() + timeout
        while self.answers() or (pid is not None and alive(pid)):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the engine at {self.socket} did not stop within {timeout:g} s")
            time.sleep(0.05)

    # ------------------------------------------------------------------ streamed answers
    def stream(self, url: str, body: dict, spec: dict, keep_alive: float) -> Iterator[dict]:
        """The server-sent events of one streamed request, as JSON objects, until `[DONE]`. An engine that goes
        away first raises EngineDied; an error event or status raises EngineUnavailable with its message."""
        connection = UnixConnection(self.socket, None)
        try:
            headers = {"Content-Type": "application/json", LOAD_HEADER: json.dumps(spec, sort_keys=True),
                       KEEP_ALIVE_HEADER: repr(keep_alive)}
            try:
                connection.request("POST", url, body=json.dumps(body), headers=headers)
                response = connection.getresponse()
            except (ConnectionError, FileNotFoundError, http.client.HTTPException) as e:
                raise EngineDied(f"the engine went away before answering ({_reason(e)})") from None
            if response.status >= 400:
                answer = _json(response.read())
                raise EngineRefused(error_message(answer, response.status), error_code(answer))
            yield from _events(response)
        finally:
            connection.close()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (an exited one that its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _events(response) -> Iterator[dict]:
    while True:
        try:
            line = response.readline()
        except (ConnectionError, http.client.HTTPException) as e:
            raise EngineDied(f"the engine went away mid-answer ({_reason(e)})") from None
        if not line:
            raise EngineDied("the engine went away mid-answer")
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            return
        event = _json(data)
        if "error" in event:
            raise EngineRefused(error_message(event, 500), error_code(event))
        yield event


def error_message(answer: dict, status: int) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message or f"the engine answered HTTP {status}"


def error_code(answer: dict) -> str | None:
    error = answer.get("error") if isinstance(answer, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _json(payload: bytes) -> dict:
    try:
        value = json.loads(payload)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


# ---------------------------------------------------------------------- finding or starting the engine
def connect(keep_alive: float, directory: Path | None = None,
            notice: Callable[[str], object] | None = None) -> Engine:
    """The engine this command should talk to: the running one when it is the same refusion in the same
    environment (`place.identity`), else a new one, started here. Two commands starting at once start one (a lock
    beside the socket); a socket nobody answers on is removed; an engine of another version is stopped (after its
    running answers) and replaced."""
    directory = directory or engine_dir()
    engine, mine = Engine(directory), identity()
    status = engine.status()
    if status is not None and status.get("identity") == mine:
        return engine
    with _start_lock(directory):
        status = engine.status()
        if status is not None and status.get("identity") == mine:
            return engine  # another command started it while this one waited
        if status is not None:
            if notice:
                notice("refusion: restarting the engine (it runs another version or environment)")
            with contextlib.suppress(EngineUnavailable):
                engine.stop()
            engine.wait_gone(pid=status.get("pid"))
        with contextlib.suppress(FileNotFoundError):
            engine.socket.unlink()  # stale: nobody answers on it
        if notice:
            notice(f"refusion: starting the resident engine, which keeps the model loaded for {keep_alive:g} s after "
                   f"each answer (--keep-alive; `refusion stop` ends it; log: {directory / LOG})")
        process = spawn(directory, keep_alive)
        wait_up(engine, process, mine)
    return engine


@contextlib.contextmanager
def _start_lock(directory: Path):
    with open(directory / START_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def spawn(directory: Path, keep_alive: float) -> subprocess.Popen:
    """Start an engine in its own session (a command's Ctrl-C does not reach it), its output in the log file."""
    log_path = directory / LOG
    mode = "wb" if log_path.exists() and log_path.stat().st_size > LOG_LIMIT else "ab"
    with open(log_path, mode) as log:
        return subprocess.Popen([sys.executable, "-m", "refusion.engine.process", "--dir", str(directory),
                                 "--keep-alive", repr(keep_alive)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=directory,
                                start_new_session=True, close_fds=True)


def wait_up(engine: Engine, process: subprocess.Popen, mine: dict, timeout: float = START_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while True:
        code = process.poll()
        if code is not None:
            raise EngineUnavailable(f"the engine exited as it started (code {code}): {last_log_line(engine.directory)}")
        with contextlib.suppress(EngineUnavailable):
            status = engine.status()
            if status is not None:
                if status.get("identity") != mine:
                    raise EngineUnavailable("the engine that started is not the one asked for")
                return
        if time.monotonic() > deadline:
            process.terminate()
            raise EngineUnavailable(f"the engine did not start within {timeout:g} s (log: {engine.directory / LOG})")
        time.sleep(0.02)


def last_log_line(directory: Path) -> str:
    try:
        lines = (directory / LOG).read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else f"no log in {directory / LOG}"


def running(directory: Path | None = None) -> Engine | None:
    """The engine when one runs (whatever its version), else None; never starts one."""
    directory = directory or engine_dir(create=False)
    if not (directory / SOCKET).exists():
        return None
    engine = Engine(directory)
    return engine if engine.status() is not None else None


def load_spec(args) -> dict:
    """The model flags of a command (`arguments.add_model_arguments`), paths made absolute: the engine runs
    elsewhere and serves every directory."""
    model = args.model
    if model is not None and os.path.exists(model):
        model = os.path.abspath(model)
    return {"model": model, "dtype": args.dtype, "device": args.device, "linear": args.linear,
            "attention": args.attention, "compile": bool(args.compile)}
