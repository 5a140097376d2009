"""A warm command is a thin client: `refusion generate` with the engine up imports neither torch nor transformers
(nor numpy), and its process stays small."""

from __future__ import annotations

import subprocess
import sys

from .conftest import TINY_FLAGS, Commands

PROBE = """
import sys
from refusion.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "numpy", "tokenizers", "safetensors", "fastapi") if m in sys.modules)
print("HEAVY", ",".join(heavy))
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")]
print("MAXRSS_KB", hwm[0])  # this process's own peak (getrusage's can hold the forking parent's)
raise SystemExit(code)
"""
CLIENT_RSS_LIMIT_MIB = 50


def test_a_warm_generate_imports_no_torch_and_stays_small(commands: Commands, tiny_model_dir):
    commands.run("generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS)  # the engine is up and holds the model
    done = subprocess.run([sys.executable, "-c", PROBE, "generate", "hi", "--model", tiny_model_dir, *TINY_FLAGS],
                          capture_output=True, text=True, env=commands.env(), timeout=300)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("HEAVY", "MAXRSS")))
    assert lines["HEAVY"].strip() == "", f"a warm command imported {lines['HEAVY']}"
    assert int(lines["MAXRSS_KB"]) / 1024 <= CLIENT_RSS_LIMIT_MIB
    assert "[" in done.stdout and "tokens" in done.stdout  # it answered, with its stats line
