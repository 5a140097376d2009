"""The embedded model under this tree's code and under an earlier commit's, side by side: AR decoding and the preset.

Each code tree decodes the same held-out prompts (`linear_kernels.prompt_groups`: none of the tuning prompts) in a
process of its own (the tree's `src` first on PYTHONPATH, so it loads its own kernels, adapter, draft table and
preset), batch 1, as a user's `refusion.load()` and `refusion.generate` would: AR decoding, then the preset's own
mode. The trees take turns group by group (the first tree alternating), so a drift of the machine touches both
alike. Reported per group and pooled: tokens/s of each tree and mode (prefill included), the ratio of this tree to
the earlier one, how many answers equal the earlier tree's (same dtype and kernels give the same bits), and how
many preset answers equal the same tree's AR answers. Ends with one JSON line.

    git worktree add /tmp/then 79a61e8
    python benchmarks/against_commit.py --then /tmp/then [--per-group 6] [--max-new-tokens 128] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOW = Path(__file__).resolve().parents[1]
"""This tree (the repository the benchmark is in)."""


def decode_group(prompts: list[str], max_new_tokens: int, dtype: str | None) -> list[dict]:
    """In a child process: decode each prompt with AR, then with the preset, through the public API only (the
    API both trees have)."""
    import warnings

    from harness import Engine, decode_interleaved, warm_up

    import refusion
    from refusion.config import layered_config
    from refusion.model.embedded import default_decode_settings_or_none
    from refusion.model.loading import encode_prompts

    warnings.filterwarnings("ignore")
    model, tokenizer = refusion.load(dtype=dtype)
    settings = default_decode_settings_or_none()
    configs = {"ar": layered_config(settings, {"max_new_tokens": max_new_tokens, "strategy": "autoregressive"}),
               "preset": layered_config(settings, {"max_new_tokens": max_new_tokens})}
    engines = [Engine(mode, model, cfg) for mode, cfg in configs.items()]
    warm_up(engines, encode_prompts(tokenizer, "Hi")[0])
    decodes = decode_interleaved(engines, [encode_prompts(tokenizer, text)[0] for text in prompts])
    rows = [{"mode": mode, "tokens": mine[i].stats.tokens, "seconds": mine[i].stats.seconds,
             "forwards": mine[i].stats.forwards, "sequence": mine[i].sequence}
            for i in range(len(prompts)) for mode, mine in decodes.items()]  # prompt by prompt, as decoded
    rows.append({"dtype": str(next(model.parameters()).dtype)})
    return rows


def run_tree(tree: Path, prompts: list[str], max_new_tokens: int, dtype: str | None) -> tuple[list[dict], str]:
    """One child process over `prompts` with `tree`'s code; its rows and its model's dtype."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    command = [sys.executable, __file__, "--child", f.name, "--max-new-tokens", str(max_new_tokens)]
    out = subprocess.run(command + (["--dtype", dtype] if dtype else []), capture_output=True, text=True, env=env,
                         check=False)
    Path(f.name).unlink()
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the child failed: {out.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return rows[:-1], rows[-1]["dtype"]


def summarize(rows: dict[str, list[dict]]) -> dict:
    """Per tree and mode: tokens/s; this tree over the earlier one; answers equal across trees and to AR."""
    entry = {}
    for tree, mine in rows.items():
        for mode in ("ar", "preset"):
            chosen = [r for r in mine if r["mode"] == mode]
            tokens, seconds = sum(r["tokens"] for r in chosen), sum(r["seconds"] for r in chosen)
            entry[f"{tree}/{mode}"] = {"tokens": tokens, "seconds": round(seconds, 3),
                                       "tokens_per_second": round(tokens / seconds, 2)}
        ar = [r["sequence"] for r in mine if r["mode"] == "ar"]
        preset = [r["sequence"] for r in mine if r["mode"] == "preset"]
        entry[f"{tree}/preset"]["identical_to_ar"] = f"{sum(a == b for a, b in zip(ar, preset))}/{len(ar)}"
    for mode in ("ar", "preset"):
        then, now = ([r["sequence"] for r in rows[t] if r["mode"] == mode] for t in ("then", "now"))
        entry[f"now/{mode}"]["identical_to_then"] = f"{sum(a == b for a, b in zip(then, now))}/{len(then)}"
        entry[f"now/{mode}"]["vs_then"] = round(entry[f"now/{mode}"]["tokens_per_second"]
                                                / entry[f"then/{mode}"]["tokens_per_second"], 3)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--then", default=None, metavar="DIR", help="a checkout of the earlier commit")
    parser.add_argument("--per-group", type=int, default=6, help="prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="both trees' dtype (default: each tree's refusion.load choice)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a JSON file of prompts to decode
    args = parser.parse_args()
    if args.child:
        print(json.dumps(decode_group(json.loads(Path(args.child).read_text()), args.max_new_tokens, args.dtype)))
        return
    if args.then is None or not (Path(args.then) / "src" / "refusion").is_dir():
        parser.error("--then must be a checkout of refusion (git worktree add DIR COMMIT)")
    from harness import emit
    from linear_kernels import prompt_groups

    trees = {"then": Path(args.then).resolve(), "now": NOW}
    rows = {"then": [], "now": []}
    dtypes, summary = {}, {}
    for i, (group, texts) in enumerate(prompt_groups(args.per_group).items()):
        order = ["then", "now"] if i % 2 == 0 else ["now", "then"]
        mine = {}
        for tree in order:
            mine[tree], dtypes[tree] = run_tree(trees[tree], texts, args.max_new_tokens, args.dtype)
            rows[tree] += mine[tree]
        summary[group] = summarize(mine)
        print(f"{group}: " + "  ".join(f"{k} {v['tokens_per_second']:.1f}" for k, v in summary[group].items()),
              flush=True)
    summary["all"] = summarize(rows)
    print("== all")
    for engine, entry in summary["all"].items():
        print(f"  {engine:12s} {entry['tokens_per_second']:7.1f} tok/s  "
              + "  ".join(f"{k} {v}" for k, v in entry.items() if k not in ("tokens", "seconds", "tokens_per_second")))
    commit = subprocess.run(["git", "-C", str(trees["then"]), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    emit({"benchmark": "against_commit", "then": commit, "dtypes": dtypes, "per_group": args.per_group,
          "max_new_tokens": args.max_new_tokens, "machine": platform.machine(), "summary": summary,
          "time": time.strftime("%Y-%m-%dT%H:%M:%S")})

if __name__ == "__main__":
    main()
