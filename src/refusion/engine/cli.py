"""`refusion ps` (what the resident engine holds) and `refusion stop` (end it after its running answers)."""

from __future__ import annotations

import argparse

from refusion.engine.client import EngineUnavailable, running


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ps", help="list the models the resident engine holds",
                              description="The models the resident engine keeps loaded for generate and chat: how "
                                          "long each has been loaded, idle, and until it is unloaded.")
    p.set_defaults(func=ps)
    p = subparsers.add_parser("stop", help="stop the resident engine (after its running answers)",
                              description="End the resident engine: it answers no new request, finishes the running "
                                          "ones, unloads its models and exits.")
    p.set_defaults(func=stop)


def ps(args: argparse.Namespace) -> int:
    engine = running()
    if engine is None:
        print("no engine is running")
        return 0
    status = engine.status() or {}
    print(f"engine pid {status.get('pid')}{' (stopping)' if status.get('stopping') else ''}"
          f"{' (loading a model)' if status.get('loading') else ''}")
    models = status.get("models", [])
    if not models:
        print("no model loaded")
        return 0
    print(f"{'MODEL':<28} {'LOADED':>8} {'IDLE':>8} {'UNLOADS IN':>11} {'RUNNING':>8}  SETUP")
    for model in models:
        spec = model.get("spec", {})
        name = spec.get("model") or "(embedded)"
        flags = " ".join(f"--{k} {v}" for k, v in spec.items() if k != "model" and v not in (None, False, "auto"))
        unloads = "-" if model.get("active") else duration(max(model["keep_alive"] - model["idle_seconds"], 0))
        print(f"{(name + (' ' + flags if flags else '')):<28} {duration(model['loaded_seconds']):>8} "
              f"{duration(model['idle_seconds']):>8} {unloads:>11} {model.get('active', 0):>8}  {model.get('setup', '')}")
    return 0


def stop(args: argparse.Namespace) -> int:
    engine = running()
    if engine is None:
        print("no engine is running")
        return 0
    try:
        pid = (engine.status() or {}).get("pid")
        answer = engine.stop()
        if answer.get("active"):
            print(f"stopping the engine after its {answer['active']} running answer(s)...", flush=True)
        engine.wait_gone(pid=pid)
    except EngineUnavailable as e:
        raise ValueError(str(e)) from None
    print("engine stopped")
    return 0


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
