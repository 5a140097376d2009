"""Plan and infill, the paper's decoding (docs/DECODING.md; paper §3).

For each block, rounds of 1. plan (draft every masked slot, select the confident ones), then `infill_round`:
2. verify the selected drafts in one forward, 3. fast accept a verified prefix, or 4. complete every selected slot
in parallel, and 5. commit with KV reuse. Fused planning (`cfg.fused_plan`) wraps a round (`with_next_plan`)
instead of running through its phases.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from refusion.decode.costs import SuccessRate, fusing_pays
from refusion.decode.infill import (
    accepted_prefix,
    cut_after_first_eos,
    fast_accept,
    force_progress,
    shared_advance,
    shifted_token_probs,
    verify_selected,
)
from refusion.decode.logprobs import TokenLogprobs
from refusion.decode.outputs import RoundTrace, SlotEvent
from refusion.decode.plan import Plan, greedy, plan_slots
from refusion.decode.sequence import Forward, Program, Sequence, masks, prefill, slot_events, zeros


@dataclass(frozen=True)
class Canvas:
    """The response positions of one sequence, cut into blocks of slots."""

    start: int
    """Position of the first response token (the prompt's length)."""
    end: int
    """One past the last position (start + the canvas length)."""
    block_size: int
    """b: positions per block (the last block may be shorter)."""
    slot_size: int
    """k: positions per slot."""
    device: torch.device
    """Where position tensors live."""

    @staticmethod
    def of(seq: Sequence) -> Canvas:
        cfg = seq.cfg
        return Canvas(seq.prompt_length, seq.prompt_length + cfg.canvas_length, cfg.block_size, cfg.slot_size,
                      seq.device)

    @property
    def blocks(self) -> int:
        return -(-(self.end - self.start) // self.block_size)

    def block_slots(self, block: int) -> torch.Tensor:
        """[n] starts of the slots of a block (none past the last block)."""
        if block >= self.blocks:
            return torch.empty(0, dtype=torch.long, device=self.device)
        start = self.start + block * self.block_size
        return torch.arange(start, min(start + self.block_size, self.end), self.slot_size, device=self.device)

    def slot_positions(self, starts: torch.Tensor) -> torch.Tensor:
        """[n * k] every position of the slots starting at `starts`, slot by slot."""
        return (starts[:, None] + torch.arange(self.slot_size, device=self.device)).flatten()


@dataclass(frozen=True)
class RoundOutcome:
    """What one round of infilling committed (steps 2-5)."""

    how: str
    """"fast_accept" or "parallel_completion"."""
    committed: list[SlotEvent]
    """The committed slots, tokens cut after EOS, in commit order."""
    committed_starts: torch.Tensor
    """[c] starts of the slots no longer masked."""
    eos_start: int | None
    """Start of the slot holding the first EOS (no later slot is decoded), or None."""
    commits_all: bool
    """Every selected slot was committed and none holds EOS: what the next plan's masks saw is the context."""
    complete_forwards: int = 0
    """Forwards of parallel completion (and of the KV recompute)."""


def refusion_program(seq: Sequence) -> Program:
    """Plan and infill, block by block; each round is 1. plan then `infill_round` (2-5)."""
    cfg = seq.cfg
    canvas = Canvas.of(seq)
    first_round, finished = True, False
    next_plan = None  # logits of the next round's masks, when they rode on the last forward (`with_next_plan`)
    plan_used = SuccessRate()  # how often a round committed everything (a plan riding on it was used)
    for block in range(canvas.blocks):
        slots = canvas.block_slots(block)  # starts of the masked slots
        while slots.numel():
            masked_slots, fused, plan_forwards = slots.tolist(), next_plan is not None, 0

            # 1. plan: draft every masked slot of the block on top of the context
            if next_plan is None:
                next_plan = yield plan_forward(seq, canvas.slot_positions(slots), first_round)
                plan_forwards = 1
                if first_round:
                    seq.commit_prompt()
                    first_round = False
                else:
                    seq.discard()
            plan = plan_slots(next_plan, cfg.slot_size, cfg.slot_threshold, cfg.temperature, seq.generator)
            starts = slots[plan.selected]
            first_logprobs = seq.logprobs_of(  # a selected slot's first token: the plan's masked distribution
                next_plan.view(*plan.drafts.shape, -1)[plan.selected, 0], plan.drafts[plan.selected, 0])
            left = slots[~torch.isin(slots, starts)]
            upcoming = left if left.numel() else canvas.block_slots(block + 1)  # what the next plan drafts

            # 2-5. verify, fast accept or complete in parallel, commit
            round_ = infill_round(seq, plan, starts, first_logprobs)
            if cfg.fused_plan and upcoming.numel():
                outcome, riding = yield from with_next_plan(round_, seq, canvas.slot_positions(upcoming), canvas.end,
                                                            plan_used)
            else:
                outcome, riding = (yield from round_), None
            next_plan = riding if outcome.commits_all else None
            plan_used.record(outcome.commits_all)

            slots = slots[~torch.isin(slots, outcome.committed_starts)]
            if outcome.eos_start is not None:
                slots, finished = slots[slots < outcome.eos_start], True
            phases = {"plan": plan_forwards, "verify": 1, "complete": outcome.complete_forwards}
            seq.record(RoundTrace(index=seq.stats.rounds, block=block, masked_slots=masked_slots,
                                  planned=slot_events(starts, list(plan.drafts[plan.selected]),
                                                      plan.scores[plan.selected]),
                                  committed=outcome.committed, how=outcome.how, forwards=sum(phases.values()),
                                  finished=outcome.eos_start is not None, phase_forwards=phases, fused_plan=fused))
        if finished:
            break
    seq.finish("eos" if finished else "length")


def plan_forward(seq: Sequence, mask_positions: torch.Tensor, first_round: bool) -> Forward:
    """The plan's forward: masks at every masked position of the block (after the prompt, in the first round)."""
    if first_round:
        return prefill(seq, mask_positions, logits_from=seq.prompt_length)
    tokens = masks(seq, mask_positions)
    return Forward(tokens, mask_positions, zeros(tokens))


def infill_round(seq: Sequence, plan: Plan, starts: torch.Tensor, first_logprobs: TokenLogprobs | None = None,
                 ) -> Generator[Forward, torch.Tensor, RoundOutcome]:
    """Steps 2-5 of a round: verify the selected drafts, then fast accept or complete them in parallel, and
    commit. `starts`: [m] starts of the selected slots; `first_logprobs`: [m] of their first drafts (when the
    config asks for logprobs)."""
    cfg, k = seq.cfg, seq.cfg.slot_size
    drafts = plan.drafts[plan.selected]  # [m, k]
    positions = starts[:, None] + torch.arange(k, device=seq.device)  # [m, k]

    # 2. verify: one forward of the selected drafts in position order, keeping its KV for now
    logits = yield Forward(drafts.flatten(), positions.flatten(), zeros(drafts.flatten()), may_end_round=True)
    ar_probs = shifted_token_probs(logits, drafts.flatten()).view_as(drafts)
    verification = verify_selected(plan.scores[plan.selected], ar_probs, cfg.token_threshold)
    logprobs = drafts_logprobs(seq, logits, drafts, first_logprobs)  # [m, k] or None
    accept = fast_accept(drafts, verification.prefix_length, seq.is_eos(drafts))

    if accept is not None:
        # 3. fast accept: the verification KV is exact for the accepted prefix; keep it
        n = accept.n_slots
        keep = (n - 1) * k + accept.last_length
        seq.commit(drafts[:n].flatten()[:keep], positions[:n].flatten()[:keep],
                   logprobs=None if logprobs is None else logprobs[:n].flatten()[:keep])
        committed = [drafts[i, : (k if i < n - 1 else accept.last_length)] for i in range(n)]
        return RoundOutcome("fast_accept", slot_events(starts[:n], committed), starts[:n],
                            int(starts[n - 1]) if accept.eos else None,
                            commits_all=not accept.eos and n == starts.numel())

    # 4. parallel completion: one row per selected slot, sharing the context KV
    seq.discard()
    rows, positions, eos_row, forwards, logprobs = yield from parallel_completion(
        seq, drafts, positions, verification.slot_accepted, logprobs)

    # 5. commit every completed row with its own KV (or recompute it: the Table 8 ablation)
    keep = cut_after_first_eos(seq.is_eos(rows.flatten()))
    tokens, token_positions = rows.flatten()[keep], positions.flatten()[keep]
    if cfg.kv_cache == "recompute":
        seq.discard()
        yield Forward(tokens, token_positions, zeros(tokens), may_end_round=eos_row is None)
        forwards += 1
    seq.commit(tokens, token_positions, logprobs=None if logprobs is None else logprobs.flatten()[keep])
    committed = list(tokens.split([int(keep.view_as(rows)[r].sum()) for r in range(rows.shape[0])]))
    return RoundOutcome("parallel_completion", slot_events(starts[: rows.shape[0]], committed), starts,
                        int(starts[eos_row]) if eos_row is not None else None, commits_all=eos_row is None,
                        complete_forwards=forwards)


def drafts_logprobs(seq: Sequence, verify_logits: torch.Tensor, drafts: torch.Tensor,
                    first_logprobs: TokenLogprobs | None) -> TokenLogprobs | None:
    """[m, k] logprobs of the selected drafts: a slot's first from the plan (`first_logprobs`, [m]), every other
    from the AR distribution of the verify forward (`verify_logits`, [m * k, V], the drafts in position order)."""
    if first_logprobs is None:
        return None
    verified = seq.shifted_logprobs_of(verify_logits, drafts.flatten()).reshape(*drafts.shape)
    first_column = torch.zeros_like(drafts, dtype=torch.bool)
    first_column[:, 0] = True
    return TokenLogprobs.where(first_column, first_logprobs.reshape(-1, 1), verified)


def completed_logprobs(logprobs: TokenLogprobs, newly: torch.Tensor, by_ar: torch.Tensor,
                       verified: TokenLogprobs, predicted: TokenLogprobs) -> TokenLogprobs:
    """[r, w] a window's logprobs after a verify forward of parallel completion: a position accepted in it
    (`newly`) by its AR probability (`by_ar`) takes the verify forward's (`verified`); one only forced
    (`force_progress`) takes the masked prediction it was filled with (`predicted`); the others keep theirs."""
    return TokenLogprobs.where(newly & by_ar, verified, TokenLogprobs.where(newly, predicted, logprobs))


def parallel_completion(seq: Sequence, drafts: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor,
                        logprobs: TokenLogprobs | None = None):
    """§3.4: complete every selected slot, each as its own row, until all positions are accepted.

    Returns (rows [r, k], positions [r, k], eos_row or None, forwards, logprobs [r, k] or None). Rows after the
    first one holding an accepted EOS are dropped. On return the cache holds each row's own KV as pending entries.
    With KV reuse, each verify forward may end the round (the fused plan rides on it). `logprobs`: [m, k] those of
    the drafts (the accepted ones are kept), when the config asks for them.
    """
    cfg, k = seq.cfg, seq.cfg.slot_size
    rows, tags = drafts.clone(), accepted.clone()
    groups = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
    shared, eos_row, forwards = 0, None, 0  # shared: cached prefix length common to all rows
    for _ in range(k):
        if bool(tags.all()):
            break
        window, window_positions = rows[:, shared:], positions[:, shared:]
        window_tags, window_groups = tags[:, shared:].bool(), groups[: rows.shape[0], shared:]

        # predict: unaccepted positions become masks and are filled with the masked prediction
        masked = torch.where(window_tags, window, seq.mask_token_id)
        logits = yield Forward(masked.flatten(), window_positions.flatten(), window_groups.flatten())
        forwards += 1
        seq.retain(positions[:, :shared].flatten())
        proposed = greedy(logits).view_as(window)
        window = torch.where(window_tags, window, proposed)
        rows[:, shared:] = window
        predicted = seq.logprobs_of(logits.view(*window.shape, -1), window)

        # verify: AR probabilities of the filled window; keep its KV
        logits = yield Forward(window.flatten(), window_positions.flatten(), window_groups.flatten(),
                               may_end_round=cfg.kv_cache == "reuse")
        forwards += 1
        probs = shifted_token_probs(logits.view(*window.shape, -1), window)
        accept = force_progress(probs > cfg.token_threshold, window_tags)
        tags[:, shared:] = accepted_prefix(accept)
        if logprobs is not None:
            newly = tags[:, shared:].bool() & ~window_tags
            verified = seq.shifted_logprobs_of(logits.view(*window.shape, -1), window)
            window_logprobs = completed_logprobs(logprobs[:, shared:], newly, probs > cfg.token_threshold, verified,
                                                 predicted)
            logprobs = TokenLogprobs.cat([logprobs[:, :shared], window_logprobs], dim=1)

        # EOS: keep rows up to the first one with an accepted EOS, which is complete
        hits = (seq.is_eos(rows[:, shared:]) & tags[:, shared:].bool()).any(1)
        if bool(hits.any()):
            eos_row = int(hits.nonzero()[0])
            rows, tags, positions = rows[: eos_row + 1], tags[: eos_row + 1], positions[: eos_row + 1]
            logprobs = None if logprobs is None else logprobs[: eos_row + 1]
            tags[eos_row] = 1

        shared += shared_advance(tags[:, shared:], bool(tags.all()))
        seq.retain(positions[:, :shared].flatten())
    if shared != k:
        raise RuntimeError(f"parallel completion ended with {shared} of {k} positions shared")
    return rows, positions, eos_row, forwards, logprobs


def with_next_plan(round_: Generator[Forward, torch.Tensor, RoundOutcome], seq: Sequence,
                   mask_positions: torch.Tensor, upto: int, plan_used: SuccessRate):
    """Fused planning: run a round, appending to each of its forwards that may end it (`Forward.may_end_round`) the
    masks of the next round's plan, as their own attention group reading every pending entry the round may commit
    (positions up to `upto`), where that pays for its width (`costs.fusing_pays`: the model's forward costs and
    `plan_used`, how often this sequence's rounds committed everything).

    Returns (the round's outcome, the masks' logits from the round's last forward, or None when that forward did
    not carry them). When the round commits everything it selected, those logits are exactly the next round's
    plan, which then costs no forward; otherwise the caller drops them and the next round plans on its own.
    """
    mask_tokens = masks(seq, mask_positions)
    request = next(round_)
    while True:
        riding = None
        batch = seq.cache.batch_size  # a batch's forward has every sequence's rows: its cost is theirs together
        if request.may_end_round and fusing_pays(seq.forward_costs, request.tokens.numel(), mask_positions.numel(),
                                                 plan_used, batch):
            group = int(request.groups.max()) + 1
            logits = yield request.with_branch(mask_tokens, mask_positions, group, upto)
            logits, riding = logits[: request.logits_count], logits[request.logits_count:]
        else:
            logits = yield request
        try:
            request = round_.send(logits)
        except StopIteration as stop:
            return stop.value, riding
