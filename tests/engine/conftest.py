"""A fresh engine directory per test module, and the commands that talk to the engine in it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from refusion.engine.place import DIR_ENV, KEEP_ALIVE_ENV
from tests.conftest import engine_processes

TINY_FLAGS = ["--max-new-tokens", "12", "--dtype", "float32", "--stats"]


class Commands:
    """`refusion ...` in a subprocess, with this module's engine directory and a keep-alive."""

    def __init__(self, directory: Path, keep_alive: str = "60"):
        self.directory, self.keep_alive = directory, keep_alive

    def env(self, **extra) -> dict:
        return {**os.environ, DIR_ENV: str(self.directory), KEEP_ALIVE_ENV: self.keep_alive, **extra}

    def run(self, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "refusion", *args], capture_output=True, text=True,
                              env=env or self.env(), timeout=600)
        if check and done.returncode != 0:
            raise AssertionError(f"refusion {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "refusion", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env or self.env())

    def engines(self) -> list:
        return engine_processes(self.directory)

    def stop_all(self) -> None:
        self.run("stop", check=False)
        for process in self.engines():
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engine")
    directory.chmod(0o700)
    commands = Commands(directory)
    yield commands
    commands.stop_all()
    assert not commands.engines()
