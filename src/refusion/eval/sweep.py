"""`refusion bench`: sweep decoding settings on one task, find the accuracy / speed Pareto front, plot it.

The AR baseline is run once on the same prompts and marked on the plot (the paper's Figure 4).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from refusion.config import MODEL_FIELDS, DecodeConfig, field_types, is_scalar, parse_value

SWEEPABLE = {f.name: field_types(DecodeConfig)[f.name] for f in dataclasses.fields(DecodeConfig)
             if f.name not in MODEL_FIELDS and is_scalar(field_types(DecodeConfig)[f.name])}
"""DecodeConfig fields a sweep may vary (every field with one number, string or bool as its value, less the
model's token ids), with their types. A point that sets `strategy` is run with that strategy, else with refusion."""
SHORT = {"slot_size": "k", "block_size": "b", "slot_threshold": "τs", "token_threshold": "τt",
         "temperature": "T", "max_new_tokens": "len", "kv_cache": "kv"}
"""Short names of some axes on the plot (the others keep their field name)."""


def parse_sweeps(specs: list[str]) -> dict[str, list]:
    """{"slot_threshold": [0.5, 0.7], ...} from ["slot_threshold=0.5,0.7", ...] (names may use dashes)."""
    sweeps: dict[str, list] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name or not values.strip():
            raise ValueError(f"--sweep {spec!r} is invalid: expected NAME=V1,V2,... (e.g. slot_size=4,8,16)")
        if name not in SWEEPABLE:
            raise ValueError(f"--sweep {spec!r}: {name!r} cannot be swept; choose from {', '.join(SWEEPABLE)}")
        if name in sweeps:
            raise ValueError(f"--sweep {spec!r}: {name} is given twice")
        parsed = []
        for text in values.split(","):
            try:
                parsed.append(parse_value(SWEEPABLE[name], text))
            except ValueError as e:
                raise ValueError(f"--sweep {spec!r}: {e}") from None
        sweeps[name] = list(dict.fromkeys(parsed))
    return sweeps


def grid(sweeps: dict[str, list]) -> list[dict]:
    """Every combination of the swept values, in the order given."""
    names = list(sweeps)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(sweeps[n] for n in names))]


def validate_grid(settings, task: str, combos: list[dict]) -> list[DecodeConfig]:
    """The DecodeConfig each grid point decodes with (`EvalSettings.decode_config`: the task's preset, then the
    point's strategy, then the overrides and the point); a one-line error naming the first bad point."""
    configs = []
    for combo in combos:
        point = dataclasses.replace(settings, overrides={**settings.overrides, **combo})
        try:
            configs.append(point.decode_config(task, combo.get("strategy", "refusion")))
        except ValueError as e:
            raise ValueError(f"sweep point {describe(combo)} is invalid: {e}") from None
    return configs


def describe(combo: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in combo.items())


def label(combo: dict) -> str:
    return " ".join(f"{SHORT.get(k, k)}={v}" for k, v in combo.items())


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """For each (tokens_per_second, accuracy), whether no other point is at least as good in both and
    strictly better in one."""
    return [not any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points) for x, y in points]


def run_sweep(model, tokenizer, task: str, sweeps: dict[str, list], settings, *, baseline: bool = True,
              generate_fn=None, processes=None, log=print) -> dict:
    """Evaluate `task` with ReFusion at every grid point (and AR once); return the sweep document."""
    from refusion.eval.runner import evaluate

    combos = grid(sweeps)
    validate_grid(settings, task, combos)
    rows, document = [], None
    for i, combo in enumerate(combos):
        strategy = combo.get("strategy", "refusion")
        point = dataclasses.replace(settings, tasks=[task], strategies=[strategy],
                                    overrides={**settings.overrides, **combo})
        document = evaluate(model, tokenizer, point, generate_fn=generate_fn, processes=processes)
        metrics = document["results"][task][strategy]
        rows.append({"strategy": strategy, "point": combo, **_row_metrics(metrics)})
        acceptance = metrics.get("draft_acceptance")
        log(f"[{i + 1}/{len(combos)}] {describe(combo)}: accuracy {100 * metrics['accuracy']:.2f}  "
            f"tokens/s {metrics['tokens_per_second']:.2f}  tokens/fwd {metrics['tokens_per_forward']:.2f}  "
            f"forwards {phase_cell(metrics.get('phase_forwards', {}))}"
            + (f"  drafts accepted {100 * acceptance:.0f}%" if acceptance is not None else ""))
    front = pareto_front([(r["tokens_per_second"], r["accuracy"]) for r in rows])
    for r, on_front in zip(rows, front, strict=True):
        r["pareto"] = on_front
    ar = None
    if baseline:
        # AR reads none of the swept plan-and-infill or exact-mode fields: the overrides alone
        point = dataclasses.replace(settings, tasks=[task], strategies=["autoregressive"])
        document = evaluate(model, tokenizer, point, generate_fn=generate_fn, processes=processes)
        ar = {"strategy": "autoregressive", "point": {}, **_row_metrics(document["results"][task]["autoregressive"])}
        log(f"[AR] accuracy {100 * ar['accuracy']:.2f}  tokens/s {ar['tokens_per_second']:.2f}")
    return {"task": task, "sweep": sweeps, "rows": rows, "baseline": ar,
            "settings": document["settings"] if document else {}, "environment": document["environment"] if document else {}}


def _row_metrics(m: dict) -> dict:
    keys = ("accuracy", "n", "tokens_per_second", "tokens_per_forward", "mean_generated_length", "latency_seconds")
    accounting = {"phase_forwards": m.get("phase_forwards", {}), "committed_by": m.get("committed_by", {}),
                  "drafted": m.get("drafted", 0), "accepted": m.get("accepted", 0),
                  "draft_acceptance": m.get("draft_acceptance")}
    return {k: m[k] for k in keys} | accounting | {"config": m["config"]}


PHASE_ORDER = ("prefill", "plan", "verify", "complete", "decode")
KIND_SHORT = {"fast_accept": "fast", "parallel_completion": "parallel", "speculative": "spec",
              "autoregressive": "AR"}
"""Short names of the kinds of round in the table."""


def phase_cell(phases: dict[str, int]) -> str:
    """"plan 12 · verify 20 · complete 8": forwards per phase, summed over the setting's sequences."""
    order = [p for p in PHASE_ORDER if p in phases] + [p for p in phases if p not in PHASE_ORDER]
    return " · ".join(f"{p} {phases[p]}" for p in order if phases[p]) or "-"


def kind_cell(committed_by: dict[str, int]) -> str:
    """"fast 30 · parallel 10": tokens committed per kind of round."""
    return " · ".join(f"{KIND_SHORT.get(k, k)} {n}" for k, n in committed_by.items() if n) or "-"


def format_sweep_table(doc: dict) -> str:
    """Markdown table: one row per grid point (Pareto points starred), then the AR baseline."""
    names = list(doc["sweep"])
    ar_tps = doc["baseline"]["tokens_per_second"] if doc.get("baseline") else None
    header = [*names, "accuracy", "tokens/s", "tokens/fwd", "mean len", "speedup vs AR", "pareto",
              "forwards by phase", "tokens by round kind", "drafts accepted"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = sorted(doc["rows"], key=lambda r: -r["tokens_per_second"])
    for r in rows + ([doc["baseline"]] if doc.get("baseline") else []):
        cells = [str(r["point"].get(n, "AR")) for n in names]
        speed = f"{r['tokens_per_second'] / ar_tps:.2f}x" if ar_tps else ""
        acceptance = r.get("draft_acceptance")
        drafts = f"{r['accepted']}/{r['drafted']} ({100 * acceptance:.0f}%)" if acceptance is not None else ""
        cells += [f"{100 * r['accuracy']:.2f}", f"{r['tokens_per_second']:.2f}", f"{r['tokens_per_forward']:.2f}",
                  f"{r['mean_generated_length']:.1f}", speed, "*" if r.get("pareto") else "",
                  phase_cell(r.get("phase_forwards", {})), kind_cell(r.get("committed_by", {})), drafts]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_pareto(doc: dict, path: str | Path) -> Path:
    """Accuracy vs tokens/s: every grid point, the Pareto front as a line, the AR baseline as a star."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.scatter([r["tokens_per_second"] for r in rows], [100 * r["accuracy"] for r in rows], color="#9aa5b1",
               s=28, label="ReFusion settings", zorder=2)
    front = sorted((r for r in rows if r.get("pareto")), key=lambda r: r["tokens_per_second"])
    ax.plot([r["tokens_per_second"] for r in front], [100 * r["accuracy"] for r in front], "-o", color="#1f6feb",
            ms=6, lw=1.8, label="Pareto front", zorder=3)
    for r in front:
        ax.annotate(label(r["point"]), (r["tokens_per_second"], 100 * r["accuracy"]), textcoords="offset points",
                    xytext=(4, 5), fontsize=7, color="#1f3b73")
    if doc.get("baseline"):
        b = doc["baseline"]
        ax.scatter([b["tokens_per_second"]], [100 * b["accuracy"]], marker="*", s=220, color="#d73a49",
                   label="autoregressive", zorder=4)
        ax.axvline(b["tokens_per_second"], color="#d73a49", lw=0.8, ls="--", zorder=1)
    n = rows[0]["n"] if rows else 0
    ax.set(xlabel="tokens per second (prefill included)", ylabel="accuracy (%)",
           title=f"{doc['task']}: accuracy vs speed (n={n})")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
