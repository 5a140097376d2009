"""`refusion serve` flags, and the command end to end in a subprocess (model load, uvicorn, one request)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_serve_parser_and_bad_flags():
    from refusion.serve import cli
    from refusion.serve.settings import SHUTDOWN_GRACE_SECONDS

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--port", "0", "--max-batch-size", "2", "--slot-size", "4",
                              "--block-size", "8", "--preset", "demo"])
    settings = cli.serve_config_from_args(args)
    assert args.func is cli.run and (settings.max_batch_size, settings.max_queue, settings.port) == (2, 64, 0)
    assert cli.served_name("/models/refusion-qwen3/") == "refusion-qwen3" and cli.served_name(None) == "refusion"
    with pytest.raises(ValueError, match="max-batch-size"):
        cli.run(parser.parse_args(["serve", "--max-batch-size", "0"]))
    with pytest.raises(ValueError, match="shutdown-grace"):
        cli.run(parser.parse_args(["serve", "--shutdown-grace", "-1"]))
    assert settings.shutdown_grace == SHUTDOWN_GRACE_SECONDS
    with pytest.raises(ValueError, match="block_size"):  # decoding flags are checked before the model loads
        cli.run(parser.parse_args(["serve", "--model", "/nonexistent", "--slot-size", "3"]))
    assert cli.main(["--model", "/nonexistent/model"]) == 2


def _listening_port(server: subprocess.Popen, timeout: float = 60.0, log: list[str] | None = None) -> int:
    """The port uvicorn reports it listens on (the command was started with --port 0); the lines logged until
    then are appended to `log`."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            assert server.poll() is None, "".join(seen)
            continue
        seen.append(line)
        match = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
        if match:
            (log if log is not None else []).extend(seen)
            return int(match.group(1))
    raise AssertionError(f"the server did not start in {timeout} s: {''.join(seen)}")


@pytest.mark.slow  # a subprocess that imports torch and loads a model
def test_serve_command_end_to_end(tmp_path, tiny):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "refusion.serve.cli", "--model", str(tmp_path), "--host", "127.0.0.1",
           "--port", "0", "--dtype", "float32", "--max-new-tokens", "8", "--slot-size", "4", "--block-size", "8",
           "--log-level", "info"]  # port 0: the OS picks a free one, uvicorn logs it
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log: list[str] = []
        url = f"http://127.0.0.1:{_listening_port(server, log=log)}"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["id"] == tmp_path.name and card["refusion"]["dtype"] == "float32"
        started = f"serving {tmp_path.name}: float32 on cpu, {card['refusion']['setup']}"
        assert any(started in line for line in log), log  # the start-up log names the dtype and kernels
        name = card["id"]
        response = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "hi"}, timeout=30).json()
        assert response["usage"]["completion_tokens"] == 8  # the --max-new-tokens default
    finally:
        server.terminate()
        server.wait(30)


def test_a_model_without_mask_token_needs_the_autoregressive_default(tiny):
    from refusion.config import DecodeConfig
    from refusion.serve.app import create_app

    model, tokenizer = tiny
    model.config.mask_token_id, saved = None, model.config.mask_token_id
    try:
        with pytest.raises(ValueError, match="mask_token_id"):
            create_app(model, tokenizer)
        create_app(model, tokenizer, config=DecodeConfig(strategy="autoregressive"))
    finally:
        model.config.mask_token_id = saved


def _start_server(tmp_path, tiny, *flags: str) -> tuple[subprocess.Popen, str]:
    """`refusion serve` on the tiny model saved in tmp_path, in a subprocess; (process, base url)."""
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "refusion.serve.cli", "--model", str(tmp_path), "--host", "127.0.0.1",
           "--port", "0", "--dtype", "float32", "--max-batch-size", "2", "--log-level", "info", *flags]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        return server, f"http://127.0.0.1:{_listening_port(server)}"
    except BaseException:
        server.kill()
        raise


@pytest.mark.slow  # two subprocesses that import torch and load a model (~10 s)
def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(tmp_path, tiny):
    import signal

    long = {"model": tmp_path.name, "prompt": "hi", "max_tokens": 900, "stream": True,
            "stream_options": {"include_usage": True}, "refusion": {"strategy": "autoregressive", "ignore_eos": True}}
    # 1. a grace period long enough: the stream in flight is answered in full
    server, url = _start_server(tmp_path / "a", tiny, "--shutdown-grace", "60")
    long["model"] = "a"
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # the signal is handled between two bytecodes of the event loop's thread
            refused = httpx.post(f"{url}/v1/completions", json={**long, "stream": False, "stream_options": None},
                                 timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            events = [first, *(line for line in lines if line.startswith("data: "))]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 900
        assert server.wait(30) == 0
    finally:
        server.kill()

    # 2. no grace: the stream in flight ends with a shutting_down error event, and the exit is still clean
    server, url = _start_server(tmp_path / "b", tiny, "--shutdown-grace", "0")
    long["model"] = "b"
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        assert any('"shutting_down"' in e for e in events) and events[-1] == "data: [DONE]"
        assert server.wait(30) == 0
    finally:
        server.kill()


def test_replica_flags(monkeypatch, capsys):
    from refusion.serve import cli
    from refusion.serve.settings import ServeConfig

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    settings = cli.serve_config_from_args(parser.parse_args(
        ["serve", "--replicas", "2", "--max-replicas", "4", "--replica-cpus", "1.5", "--replica-gpus", "0"]))
    assert (settings.replicas, settings.max_replicas, settings.replica_cpus, settings.replica_gpus) == (2, 4, 1.5, 0)
    assert (settings.ray_dashboard, settings.replica_stall_timeout) == (False, 120.0)  # the dashboard off by default
    settings = cli.serve_config_from_args(parser.parse_args(
        ["serve", "--replicas", "2", "--ray-dashboard", "--replica-stall-timeout", "30"]))
    assert (settings.ray_dashboard, settings.replica_stall_timeout) == (True, 30.0)
    with pytest.raises(ValueError, match="--max-replicas=1 is invalid: must be >= --replicas=2"):
        ServeConfig(replicas=2, max_replicas=1)
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray Serve not installed: one line naming the extra
    assert cli.main(["--replicas", "2"]) == 2
    assert capsys.readouterr().err.strip() == \
        "refusion serve: error: --replicas needs Ray Serve: pip install 'refusion[replicas]'"


class LoadStop(ValueError):
    """Raised by a patched loader once it has seen what it checks (the command then ends with a one-line error)."""


def test_serve_threads_are_set_before_the_model_loads(monkeypatch, tiny_model_dir):
    """`refusion serve --threads N`: torch runs N threads when the model loads (the calibration record is looked up
    there, keyed by the count), not only once the server starts."""
    import torch

    from refusion.cli import main
    from refusion.serve import cli

    seen = []

    def load(args, device=None):
        seen.append(torch.get_num_threads())
        raise LoadStop("stop after the load")

    saved = torch.get_num_threads()
    wanted = saved + 2  # not what this package's servers run on (conftest), nor the machine's default
    monkeypatch.setattr(cli, "load_from_args", load)
    try:
        assert main(["serve", "--model", tiny_model_dir, "--threads", str(wanted), "--port", "0"]) == 2
        assert seen == [wanted]
        assert cli.main(["--model", tiny_model_dir, "--threads", str(wanted + 1), "--port", "0"]) == 2
        assert seen == [wanted, wanted + 1]  # `python -m refusion.serve.cli` too
    finally:
        torch.set_num_threads(saved)


def test_a_replica_sets_its_threads_before_its_model_loads(monkeypatch):
    import torch

    from refusion.config import DecodeConfig
    from refusion.serve import replicas
    from refusion.serve.settings import ServeConfig

    seen = []
    monkeypatch.setattr(replicas.LoadSpec, "load", lambda self: seen.append(torch.get_num_threads()) or (None, None))
    saved = torch.get_num_threads()
    try:
        replicas.EngineReplica(replicas.LoadSpec(), DecodeConfig(), ServeConfig(), "m", threads=saved + 3)
        assert seen == [saved + 3]
    finally:
        torch.set_num_threads(saved)
