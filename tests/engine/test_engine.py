"""`refusion generate` through the resident engine on a tiny saved model: the same answers and counts as in-process,
one engine however many commands start it, `ps` and `stop`, keep-alive, and the faults a user meets (a stale socket,
another version, a dead engine, another user)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from refusion.engine.client import Engine
from refusion.engine.place import SOCKET

from .conftest import TINY_FLAGS, Commands

STRATEGY_FLAGS = {
    "speculative": ["--strategy", "speculative", "--draft-length", "3"],
    "autoregressive": ["--strategy", "autoregressive"],
    "refusion": ["--strategy", "refusion", "--slot-size", "4", "--block-size", "8"],
}
STATS = re.compile(r"\[(\w+) \| tokens (\d+) \| forwards (\d+) \((.*?)\) \| tokens/forward [\d.]+(?: \| drafts "
                   r"accepted (\d+)/(\d+))? \| tokens/s [\d.]+ \| [\d.]+ s \| (\w+)\]")


def answer_and_counts(out: str) -> tuple[str, list[tuple]]:
    """The printed text without the timings, and each stats line's counts."""
    counts = [m.groups() for m in STATS.finditer(out)]
    return STATS.sub("[stats]", out), counts


@pytest.mark.parametrize("strategy", sorted(STRATEGY_FLAGS))
def test_engine_answers_as_in_process(commands: Commands, tiny_model_dir, strategy):
    """The same text and stats counts; several prompts are answered one after another, each as it is alone."""
    flags = ["--model", tiny_model_dir, *TINY_FLAGS, *STRATEGY_FLAGS[strategy]]
    alone = [commands.run("generate", prompt, *flags, "--keep-alive", "0").stdout
             for prompt in ("what is 2+2?", "tell me a story")]
    through = commands.run("generate", "what is 2+2?", *flags)
    assert commands.engines(), "no engine started"
    again = commands.run("generate", "what is 2+2?", "tell me a story", *flags)  # warm: the engine was up
    assert answer_and_counts(through.stdout) == answer_and_counts(alone[0])
    setup, first, second = re.split(r"\n--- \[\d\] .*\n", again.stdout)
    assert answer_and_counts(setup + "\n" + first) == answer_and_counts(alone[0].rstrip("\n"))
    assert answer_and_counts(second) == answer_and_counts(alone[1].split("\n", 1)[1])


def test_ps_lists_the_model_and_stop_ends_the_engine(commands: Commands, tiny_model_dir):
    commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS)
    listed = commands.run("ps").stdout
    assert tiny_model_dir in listed and "engine pid" in listed
    pid = int(re.search(r"engine pid (\d+)", listed).group(1))
    assert commands.run("stop").stdout.strip().endswith("engine stopped")
    assert not (commands.directory / SOCKET).exists()
    assert not any(p.pid == pid for p in commands.engines())
    assert commands.run("ps").stdout.strip() == "no engine is running"


def test_two_commands_at_once_start_one_engine(commands: Commands, tiny_model_dir):
    commands.stop_all()
    log_path = commands.directory / "engine.log"
    before = log_path.stat().st_size if log_path.exists() else 0
    started = [commands.start("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in started]
    assert all(p.returncode == 0 for p in started), outputs
    assert answer_and_counts(outputs[0][0]) == answer_and_counts(outputs[1][0])
    assert len(commands.engines()) == 1
    log = log_path.read_bytes()[before:].decode()
    assert len(re.findall(r"loading .*" + re.escape(tiny_model_dir), log)) == 1  # loaded once


def test_a_stale_socket_is_cleaned_up(commands: Commands, tiny_model_dir):
    commands.stop_all()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(commands.directory / SOCKET))  # a socket file nobody listens on (an engine killed -9)
    stale.close()
    done = commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS)
    assert STATS.search(done.stdout), done.stdout
    assert "in this process" not in done.stderr and len(commands.engines()) == 1


def test_another_version_restarts_the_engine(commands: Commands, tiny_model_dir):
    commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS)
    [before] = commands.engines()
    other = commands.env(REFUSION_TEST_IDENTITY="another build")  # a REFUSION_ variable: part of the identity
    done = commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS, env=other)
    assert "restarting the engine" in done.stderr
    [after] = commands.engines()
    assert after.pid != before.pid


def test_keep_alive_unloads_and_the_engine_exits(tmp_path, tiny_model_dir):
    tmp_path.chmod(0o700)
    short = Commands(tmp_path, keep_alive="1")
    try:
        short.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS)
        deadline = time.monotonic() + 30
        while short.engines() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not short.engines() and not (tmp_path / SOCKET).exists()
        assert "idle for 1 s" in (tmp_path / "engine.log").read_text()
    finally:
        short.stop_all()


def test_one_model_resident_the_least_recently_used_goes(commands: Commands, tiny_model_dir):
    commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS)
    commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS, "--linear", "plain")
    status = Engine(commands.directory).status()
    assert [m["spec"]["linear"] for m in status["models"]] == ["plain"]


def read_request(conn) -> str:
    """One whole request's head (its body read and dropped), as the real engine reads it before answering: the
    client sends head and body in two writes, and closing after the first would break its pipe on the second."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return data.decode()
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        piece = conn.recv(65536)
        if not piece:
            break
        body += piece
    return head.decode()


class DyingEngine:
    """A fake engine on the socket: it answers its status as the real one would, then starts an answer and dies."""

    def __init__(self, directory):
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(directory / SOCKET))
        self.server.listen(8)
        import threading

        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                head = read_request(conn)
                if not head:  # a probe that only connects
                    continue
                if head.startswith("GET /engine/status"):
                    from refusion.engine.place import identity

                    body = json.dumps({"identity": identity(), "pid": 0, "models": []}).encode()
                elif head.startswith("POST /engine/load"):
                    body = json.dumps({"setup": "fake", "chat_template": True}).encode()
                else:  # an answer: headers, one piece of text, then the connection drops
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "partial"}}]}\n\n'
                    conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    continue
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))

    def close(self):
        self.server.close()


def test_an_engine_dying_mid_answer_is_one_line_and_a_retry_in_process(tmp_path, tiny_model_dir, monkeypatch,
                                                                         capsys):
    from refusion.cli import main
    from refusion.engine.place import DIR_ENV, KEEP_ALIVE_ENV

    tmp_path.chmod(0o700)
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.setenv(KEEP_ALIVE_ENV, "60")
    fake = DyingEngine(tmp_path)
    try:
        assert main(["generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS]) == 0
    finally:
        fake.close()
        Commands(tmp_path).stop_all()  # had the command started a real engine
    captured = capsys.readouterr()
    assert captured.err.count("went away") == 1 and "went away mid-answer" in captured.err
    assert "answering again in this process" in captured.err
    monkeypatch.setenv(KEEP_ALIVE_ENV, "0")
    assert main(["generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS]) == 0
    assert answer_and_counts(capsys.readouterr().out)[1] == answer_and_counts(captured.out)[1]


def test_another_users_connection_is_refused(tmp_path):
    """The engine serves its owner only: started for another uid, it closes this user's connections unanswered."""
    tmp_path.chmod(0o700)
    process = subprocess.Popen([sys.executable, "-m", "refusion.engine.process", "--dir", str(tmp_path),
                                "--keep-alive", "30", "--allowed-uid", str(os.getuid() + 1)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        engine = Engine(tmp_path)
        deadline = time.monotonic() + 120
        while not engine.answers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.answers(), "the engine did not start"
        from refusion.engine.client import EngineUnavailable

        with pytest.raises(EngineUnavailable, match="did not answer"):
            engine.call("GET", "/engine/status")
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "refused a connection from another user" in err


def test_chat_through_the_engine_answers_as_in_process(commands: Commands, tiny_model_dir):
    """Two turns and /stats: the same answers and stats counts; the engine keeps the model between turns."""
    flags = ["chat", "--model", tiny_model_dir, "--max-new-tokens", "12", "--dtype", "float32"]
    lines = "what is 2+2?\nand 3+3?\n/stats\n"

    def session(*extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "refusion", *flags, *extra], input=lines, capture_output=True,
                              text=True, env=commands.env(), timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout + "\n".join(line for line in done.stderr.splitlines() if line.startswith("["))

    local, through = session("--keep-alive", "0"), session()
    assert answer_and_counts(through) == answer_and_counts(local)
    assert len(answer_and_counts(local)[1]) == 1 and commands.engines()
