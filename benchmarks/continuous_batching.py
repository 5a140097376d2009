"""The server's batching loop without the server: where a continuous batch's steps go, in one process.

`refusion serve` keeps up to `--max-batch-size` sequences in one `Decoder` and steps them together, admitting a
waiting request as soon as one finishes, so most steps are one-token rows of the live sequences and some carry a new
request's whole prompt beside them. This benchmark runs that loop (`Decoder.add` when a sequence finishes,
`Decoder.step` otherwise) over the serving benchmark's held-out prompts (`serving.held_out_prompts`) with `--live`
sequences at a time, without HTTP, streaming or the event loop, and reports for each strategy (AR and the preset's
exact mode, taking turns `--rounds` times; each strategy's fastest round counts):

* output tokens/s over the whole run;
* steps, forward milliseconds per step, apart for steps that prefill a prompt and steps that do not;
* host milliseconds per step: the step's work outside the forward (the programs, drafting and its decision,
  sampling, the cache's bookkeeping);
* drafts verified and accepted (the exact mode's; where the step's decision finds that no draft pays at the batch's
  width, the exact mode takes AR steps and its drafter's work is all it adds).

What the server adds on top of these numbers is its own (`serving.py --library` compares it with the library at one
client). `--scheduler` runs the prompts through the server's scheduler instead (`serve.scheduler.Scheduler`, its
thread, admission and the text it streams after each step; no HTTP, no event loop), all submitted at once with
`--live` rows: host milliseconds a step are then everything but the forward, admission and streaming included.
`--lockstep` runs the strategies' batches side by side instead, one step of each in turn, each timed over its own
steps: on a machine whose speed drifts between runs (E5: 10-40 % a minute apart), their ratio in a round is then the
steps' own, where separate runs' ratios swing by more than a strategy changes. Ends with one JSON line (with the
preset's tokens/s over AR's in each round).

    python benchmarks/continuous_batching.py [--live 8] [--per-task 12] [--max-tokens 128] [--linear int4-q8]
                                            [--strategies autoregressive,preset] [--rounds 2]
                                            [--scheduler | --lockstep]
"""

from __future__ import annotations

import argparse
import time

from harness import conditions, cpu_name, emit
from serving import held_out_prompts

import refusion
from refusion.model.setup import setup_of
from refusion.serve.scheduler import DECODER_CAPACITY


def strategy_config(setup, strategy: str, max_tokens: int):
    """The config a request of `strategy` decodes with ("preset": the model's own, as the server's default) and its
    special tokens."""
    from refusion.config import layered_config
    from refusion.decode.loop import default_config

    chosen = {"max_new_tokens": max_tokens, **({} if strategy == "preset" else {"strategy": strategy})}
    cfg = layered_config(default_config(setup).to_dict(), explicit=chosen)
    return cfg, setup.special_tokens.for_decoding(cfg)


class BatchRun:
    """One strategy's continuous batch over `prompts`, stepped from outside: at most `live` sequences at a time,
    each new one admitted when another finishes. Its seconds are those of its own steps and admissions, so that
    runs stepped in turn (`lockstep`) are each timed alone."""

    def __init__(self, model, prompts: list[list[int]], live: int, strategy: str, max_tokens: int):
        from refusion.decode.loop import Decoder

        begin = time.perf_counter()
        setup = setup_of(model)
        self.cfg, self.tokens = strategy_config(setup, strategy, max_tokens)
        self.decoder = Decoder(model, capacity=DECODER_CAPACITY, setup=setup)  # as the server's scheduler starts it
        self.waiting = list(prompts)
        self.out = {"tokens": 0, "drafted": 0, "accepted": 0, "steps": 0, "prefill_steps": 0,
                    "prefill_forward_s": 0.0, "step_forward_s": 0.0, "host_s": 0.0, "seconds": 0.0}
        for _ in range(min(live, len(self.waiting))):
            self.admit()
        self.out["seconds"] += time.perf_counter() - begin

    @property
    def live(self) -> bool:
        return bool(self.decoder.live)

    def admit(self) -> None:
        self.decoder.add(self.waiting.pop(0), self.cfg, mask_token_id=self.tokens.mask_token_id,
                         eos_token_ids=list(self.tokens.eos_token_ids))

    def step(self) -> None:
        """One step of the batch, and the admissions of the sequences that take the finished ones' rows."""
        out, decoder = self.out, self.decoder
        begin = time.perf_counter()
        prefills = any(r.seq.stats.forwards == 0 for r in decoder.live.values())  # a new sequence's first forward
        forward_before, step_begin = decoder.stats.forward_seconds, time.perf_counter()
        finished = decoder.step()
        forward = decoder.stats.forward_seconds - forward_before
        out["host_s"] += time.perf_counter() - step_begin - forward  # the decoder's step alone, as run_batch timed it
        out["steps"] += 1
        out["prefill_steps"] += prefills
        out["prefill_forward_s" if prefills else "step_forward_s"] += forward
        for seq in finished:
            out["tokens"] += seq.stats.tokens
            out["drafted"] += seq.stats.drafted
            out["accepted"] += seq.stats.accepted
            if self.waiting:
                self.admit()
        out["seconds"] += time.perf_counter() - begin

    def result(self) -> dict:
        out = dict(self.out)
        out["tokens_per_second"] = out["tokens"] / out["seconds"]
        steps, plain = out["steps"], out["steps"] - out["prefill_steps"]
        out["forward_ms_per_prefill_step"] = 1e3 * out["prefill_forward_s"] / max(out["prefill_steps"], 1)
        out["forward_ms_per_other_step"] = 1e3 * out["step_forward_s"] / max(plain, 1)
        out["host_ms_per_step"] = 1e3 * out["host_s"] / max(steps, 1)
        return out


def run_batch(model, prompts: list[list[int]], live: int, strategy: str, max_tokens: int) -> dict:
    """Decode `prompts` with at most `live` sequences at a time, each new one admitted when another finishes."""
    run = BatchRun(model, prompts, live, strategy, max_tokens)
    while run.live:
        run.step()
    return run.result()


def run_lockstep(model, prompts: list[list[int]], live: int, strategies: list[str], max_tokens: int) -> dict:
    """Each strategy's continuous batch over the same prompts, side by side in this process, one step of each in
    turn: every strategy meets the machine's slow and fast moments alike (on E5 the forwards of one run drift by
    10-40 % from a run a minute later, more than a strategy changes a step), so the ratio of their tokens/s is the
    steps' own."""
    runs = {strategy: BatchRun(model, prompts, live, strategy, max_tokens) for strategy in strategies}
    while any(run.live for run in runs.values()):
        for run in runs.values():
            if run.live:
                run.step()
    return {strategy: run.result() for strategy, run in runs.items()}


def run_scheduler(model, tokenizer, prompts: list[list[int]], live: int, strategy: str, max_tokens: int) -> dict:
    """Decode `prompts` through the server's scheduler with `live` rows, every prompt submitted at once."""
    import threading

    from refusion.serve.scheduler import Job, Scheduler

    cfg, tokens = strategy_config(setup_of(model), strategy, max_tokens)
    ended, out = threading.Semaphore(0), {"tokens": 0, "drafted": 0, "accepted": 0}

    def emit(event) -> None:
        if event.final:
            stats = event.stats or {}
            out["tokens"] += event.completion_tokens
            out["drafted"] += stats.get("drafted", 0)
            out["accepted"] += stats.get("accepted", 0)
            ended.release()

    scheduler = Scheduler(model, tokenizer, max_batch_size=live, decoder_capacity=DECODER_CAPACITY)
    scheduler.start()
    try:
        jobs = [Job(p, cfg, tokens.mask_token_id, list(tokens.eos_token_ids), emit) for p in prompts]
        begin = time.perf_counter()
        scheduler.submit(jobs)
        for _ in jobs:
            ended.acquire()
        out["seconds"] = time.perf_counter() - begin
    finally:
        scheduler.stop()
    steps, forward = scheduler.counters["steps"], scheduler.decoder.stats.forward_seconds
    out.update(steps=steps, forward_s=forward, tokens_per_second=out["tokens"] / out["seconds"],
               host_ms_per_step=1e3 * (out["seconds"] - forward) / max(steps, 1))
    return out


def print_batch(round_index: int, strategy: str, result: dict) -> None:
    print(f"round {round_index} {strategy:>14}: {result['tokens_per_second']:6.1f} tokens/s, {result['steps']} steps "
          f"({result['prefill_steps']} with a prefill: {result['forward_ms_per_prefill_step']:.0f} ms each), other "
          f"steps {result['forward_ms_per_other_step']:.1f} ms, host {result['host_ms_per_step']:.2f} ms/step, drafts "
          f"accepted {result['accepted']}/{result['drafted']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=8, help="sequences decoded together (the server's slots)")
    parser.add_argument("--per-task", type=int, default=12, help="held-out prompts of each task slice")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--linear", default="int4-q8")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--strategies", default="autoregressive,preset")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scheduler", action="store_true",
                        help="through the server's scheduler (admission, streamed text), without HTTP")
    parser.add_argument("--lockstep", action="store_true",
                        help="the strategies' batches side by side, one step of each in turn (each round)")
    args = parser.parse_args()
    if args.lockstep and args.scheduler:
        parser.error("--lockstep steps the library's loop: it cannot run through --scheduler")
    model, tokenizer = refusion.load(linear=args.linear, **({"dtype": args.dtype} if args.dtype else {}))
    prompts = refusion.encode_prompts(tokenizer, held_out_prompts(args.per_task))
    strategies = args.strategies.split(",")
    run_batch(model, prompts[:2], 2, strategies[0], 8)  # warm: kernels set up, forward costs read
    rounds: dict[str, list[dict]] = {s: [] for s in strategies}
    for r in range(args.rounds):
        if args.lockstep:
            for strategy, result in run_lockstep(model, prompts, args.live, strategies, args.max_tokens).items():
                print_batch(r, strategy, result)
                rounds[strategy].append(result)
            continue
        for strategy in strategies:
            if args.scheduler:
                result = run_scheduler(model, tokenizer, prompts, args.live, strategy, args.max_tokens)
                print(f"round {r} {strategy:>14}: {result['tokens_per_second']:6.1f} tokens/s through the scheduler, "
                      f"{result['steps']} steps, forward {result['forward_s']:.1f} s, host "
                      f"{result['host_ms_per_step']:.2f} ms/step, drafts accepted {result['accepted']}/"
                      f"{result['drafted']}", flush=True)
            else:
                result = run_batch(model, prompts, args.live, strategy, args.max_tokens)
                print_batch(r, strategy, result)
            rounds[strategy].append(result)
    best = {s: max(rs, key=lambda x: x["tokens_per_second"]) for s, rs in rounds.items()}
    report = {"benchmark": "continuous_batching", "scheduler": args.scheduler, "lockstep": args.lockstep,
              "live": args.live, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "linear": args.linear, "setup": setup_of(model).describe(),
              "cpu": cpu_name(), "best": best, "rounds": rounds, **conditions()}
    if "preset" in best and "autoregressive" in best:
        report["preset_over_ar"] = best["preset"]["tokens_per_second"] / best["autoregressive"]["tokens_per_second"]
        report["preset_over_ar_by_round"] = [p["tokens_per_second"] / a["tokens_per_second"]
                                             for p, a in zip(rounds["preset"], rounds["autoregressive"])]
        print(f"preset over AR: {report['preset_over_ar']:.3f} (fastest rounds); by round: "
              + ", ".join(f"{x:.3f}" for x in report["preset_over_ar_by_round"]))
    emit(report)


if __name__ == "__main__":
    main()
