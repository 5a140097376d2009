"""Decoding programs: the algorithm of one sequence, written as straight-line code.

A program is a generator. Each time it needs the model it yields a `Forward` (its new tokens, their
position ids and groups) and receives the logits of those tokens; the batching loop (`loop.py`) runs the
forwards of every live sequence of a batch together. Between forwards a program commits, retains or
discards its pending KV entries through `Sequence`, which owns its row of the `SlotCache`.

ReFusion (docs/DECODING.md, paper §3): for each block, rounds of 1. plan, 2. verify, then 3. fast accept or
4. parallel completion, and 5. commit with KV reuse. The autoregressive baseline runs on the same engine.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from functools import partial

import torch

from refusion.config import DecodeConfig
from refusion.decode.cache import SlotCache
from refusion.decode.infill import (
    accepted_prefix,
    cut_after_first_eos,
    fast_accept,
    force_progress,
    shared_advance,
    shifted_token_probs,
    verify_selected,
)
from refusion.decode.outputs import RoundTrace, SequenceStats, SlotEvent
from refusion.decode.plan import greedy, next_token, plan_slots
from refusion.decode.speculate import (
    Drafts,
    accept_drafts,
    confident_drafts,
    copied_drafts,
    draft_tokens_from_masks,
    text_drafts,
)
from refusion.model.draft_table import DraftTable


@dataclass
class Forward:
    """One sequence's share of a batched forward."""

    tokens: torch.Tensor
    """[T] input ids."""
    positions: torch.Tensor
    """[T] position ids (true text positions)."""
    groups: torch.Tensor
    """[T] group of each token: a token sees the context, and earlier tokens of its own group."""
    logits_from: int = 0
    """Logits are returned for tokens[logits_from:]."""
    lower_upto: torch.Tensor | None = None
    """[T] or None: a token also sees the pending entries of every lower group at positions <= this (-1: none)."""

    def with_branch(self, tokens: torch.Tensor, positions: torch.Tensor, group: int, upto: int) -> Forward:
        """This forward plus `tokens` appended as group `group`, reading lower groups' entries up to `upto`."""
        lower = self.lower_upto if self.lower_upto is not None else torch.full_like(self.positions, -1)
        return Forward(torch.cat([self.tokens, tokens]), torch.cat([self.positions, positions]),
                       torch.cat([self.groups, torch.full_like(tokens, group)]), self.logits_from,
                       torch.cat([lower, torch.full_like(tokens, upto)]))


Program = Generator[Forward, torch.Tensor, None]


class Sequence:
    """State of one sequence: prompt, committed tokens, settings, statistics and trace.

    Programs change it only through its verbs: `commit`, `retain`, `discard` (the sequence's row of the
    `SlotCache`), `record` (a finished round) and `finish` (why it ended)."""

    def __init__(self, seq_id: int, prompt: list[int], cfg: DecodeConfig, *, mask_token_id: int | None,
                 eos_token_ids: list[int], cache: SlotCache, device: torch.device,
                 generator: torch.Generator | None = None, trace: bool = False, on_round=None,
                 draft_table: DraftTable | None = None):
        self.id, self.cfg, self.cache, self.device = seq_id, cfg, cache, device
        self.draft_table = draft_table  # the model's n-gram drafts (exact mode, cfg.table_length), or None
        self.prompt = torch.tensor(prompt, dtype=torch.long, device=device)
        self.mask_token_id = mask_token_id
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
        self.generator = generator
        self.committed_tokens: list[torch.Tensor] = []
        self.committed_positions: list[torch.Tensor] = []
        self.stats = SequenceStats()
        self.rounds: list[RoundTrace] | None = [] if trace else None
        self.on_round = on_round
        self.started = time.perf_counter()
        self.finished = False
        cache.add_sequence(seq_id)
        self.program: Program = PROGRAMS[cfg.strategy](self)

    @property
    def prompt_length(self) -> int:
        return self.prompt.numel()

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.eos_ids)

    def commit(self, tokens: torch.Tensor, positions: torch.Tensor, *, cached: bool = True,
               group: int | None = None) -> None:
        """Append tokens to the context; their pending KV entries (of `group`, where several groups hold a
        position) become context (KV reuse). `cached=False` for tokens that end the sequence before any
        forward saw them (they have no KV)."""
        if cached:
            self.cache.commit(self.id, positions, group)
        self.committed_tokens.append(tokens)
        self.committed_positions.append(positions)

    def retain(self, positions: torch.Tensor) -> None:
        """Keep the pending KV entries at `positions` pending; drop every other pending entry."""
        self.cache.retain(self.id, positions)

    def discard(self) -> None:
        """Drop every pending KV entry: the cache holds exactly the context again."""
        self.cache.discard(self.id)

    def record(self, rnd: RoundTrace) -> None:
        self.stats.add_round(rnd)
        if self.rounds is not None:
            self.rounds.append(rnd)
        if self.on_round is not None:
            self.on_round(self, rnd)

    def finish(self, reason: str) -> None:
        """The program is done: "eos" (it committed an end-of-sequence token) or "length"."""
        self.stats.finish_reason = reason
        self.stats.tokens = len(self.response())

    def _committed_in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, positions) of the context sorted by position."""
        tokens, positions = torch.cat(self.committed_tokens), torch.cat(self.committed_positions)
        order = torch.argsort(positions)
        return tokens[order], positions[order]

    def _as_response(self, tokens: torch.Tensor) -> list[int]:
        """Response tokens cut after the first EOS and at max_new_tokens."""
        return tokens[cut_after_first_eos(self.is_eos(tokens))][: self.cfg.max_new_tokens].tolist()

    def response(self) -> list[int]:
        """Committed response tokens in position order, up to and including the first EOS."""
        if not self.committed_tokens:
            return []
        tokens, positions = self._committed_in_order()
        return self._as_response(tokens[positions >= self.prompt_length])

    def contiguous_response(self) -> list[int]:
        """The response prefix whose every position is committed (what a stream may show)."""
        if not self.committed_tokens:
            return []
        tokens, positions = self._committed_in_order()
        present = torch.zeros(self.prompt_length + self.cfg.canvas_length + 1, dtype=torch.bool, device=self.device)
        present[positions] = True
        missing = (~present[self.prompt_length:]).nonzero()
        end = self.prompt_length + (int(missing[0]) if missing.numel() else self.cfg.canvas_length)
        return self._as_response(tokens[(positions >= self.prompt_length) & (positions < end)])


def _slot_events(starts: torch.Tensor, tokens: list[torch.Tensor], scores=None) -> list[SlotEvent]:
    return [SlotEvent(int(s), t.tolist(), None if scores is None else float(scores[i]))
            for i, (s, t) in enumerate(zip(starts, tokens))]


def _masks(seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
    return torch.full_like(positions, seq.mask_token_id)


def _zeros(tokens: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(tokens)


def _prefill(seq: Sequence, mask_positions: torch.Tensor, logits_from: int) -> Forward:
    """The first forward of every mode: the prompt, then masks at `mask_positions` (none for AR), one group;
    logits from `logits_from` on."""
    prompt_positions = torch.arange(seq.prompt_length, device=seq.device)
    if not mask_positions.numel():
        return Forward(seq.prompt, prompt_positions, _zeros(seq.prompt), logits_from)
    tokens = torch.cat([seq.prompt, _masks(seq, mask_positions)])
    return Forward(tokens, torch.cat([prompt_positions, mask_positions]), _zeros(tokens), logits_from)


def _with_masks(seq: Sequence, mask_positions: torch.Tensor, upto: int, request: Forward) -> Forward:
    """`request` plus masks at `mask_positions` as a new group reading every lower group's pending entries
    up to position `upto` (the fused plan: the next round's masks over everything the round may commit)."""
    group = int(request.groups.max()) + 1
    return request.with_branch(_masks(seq, mask_positions), mask_positions, group, upto)


# --------------------------------------------------------------------------------- ReFusion
def refusion_program(seq: Sequence) -> Program:
    """Plan and infill, block by block (docs/DECODING.md; paper §3).

    Fused planning (`cfg.fused_plan`): the masks of the slots that will be left after this round ride on the
    round's last forward as their own attention group, reading every token the round may commit. When the
    round commits all it selected, their logits are exactly the next round's plan, which then costs no
    forward; otherwise they are dropped and the next round plans with a forward of its own.
    """
    cfg, k, device = seq.cfg, seq.cfg.slot_size, seq.device
    offsets = torch.arange(k, device=device)
    prompt_length = seq.prompt_length
    canvas_end = prompt_length + cfg.canvas_length
    block_starts = list(range(prompt_length, canvas_end, cfg.block_size))

    def block_slots(block: int) -> torch.Tensor:
        """Starts of the slots of a block."""
        if block >= len(block_starts):
            return torch.empty(0, dtype=torch.long, device=device)
        start = block_starts[block]
        return torch.arange(start, min(start + cfg.block_size, canvas_end), k, device=device)

    def slot_positions(starts: torch.Tensor) -> torch.Tensor:
        return (starts[:, None] + offsets).flatten()

    first_round, finished = True, False
    next_plan = None  # logits of the next round's masks, when they rode on the last forward
    for block in range(len(block_starts)):
        slots = block_slots(block)  # starts of the masked slots
        while slots.numel():
            masked_slots, phases, fused = slots.tolist(), {"plan": 0, "verify": 0, "complete": 0}, next_plan is not None

            # 1. plan: draft every masked slot of the block on top of the context
            if next_plan is None:
                mask_positions = slot_positions(slots)
                if first_round:
                    request = _prefill(seq, mask_positions, logits_from=prompt_length)
                else:
                    masks = _masks(seq, mask_positions)
                    request = Forward(masks, mask_positions, _zeros(masks))
                next_plan = yield request
                phases["plan"] += 1
                if first_round:
                    seq.commit(seq.prompt, torch.arange(prompt_length, device=device))
                    first_round = False
                else:
                    seq.discard()
            plan = plan_slots(next_plan, k, cfg.slot_threshold, cfg.temperature, seq.generator)
            next_plan = None
            selected = plan.selected
            drafts = plan.drafts[selected]  # [m, k]
            starts = slots[selected]
            positions = starts[:, None] + offsets  # [m, k]
            planned = _slot_events(starts, list(drafts), plan.scores[selected])
            left = slots[~torch.isin(slots, starts)]
            upcoming = left if left.numel() else block_slots(block + 1)  # what the next plan drafts
            fuse = cfg.fused_plan and upcoming.numel() > 0

            with_next_plan = partial(_with_masks, seq, slot_positions(upcoming), canvas_end)

            # 2. verify: one forward of the selected drafts in position order, keeping its KV for now
            request = Forward(drafts.flatten(), positions.flatten(), _zeros(drafts.flatten()))
            logits = yield with_next_plan(request) if fuse else request
            phases["verify"] += 1
            logits, fused_logits = logits[: drafts.numel()], logits[drafts.numel():]
            ar_probs = shifted_token_probs(logits, drafts.flatten()).view_as(drafts)
            verification = verify_selected(plan.confidence[selected, 0], ar_probs, cfg.token_threshold)
            accept = fast_accept(drafts, verification.prefix_length, seq.is_eos(drafts))

            if accept is not None:
                # 3. fast accept: the verification KV is exact for the accepted prefix; keep it
                n = accept.n_slots
                keep = (n - 1) * k + accept.last_length
                seq.commit(drafts[:n].flatten()[:keep], positions[:n].flatten()[:keep])
                committed = [drafts[i, : (k if i < n - 1 else accept.last_length)] for i in range(n)]
                slots = slots[~torch.isin(slots, starts[:n])]
                if accept.eos:
                    slots, finished = slots[slots < starts[n - 1]], True
                elif fuse and n == starts.numel():
                    next_plan = fused_logits
                seq.record(RoundTrace(seq.stats.rounds, block, masked_slots, planned,
                                      _slot_events(starts[:n], committed), "fast_accept", sum(phases.values()),
                                      accept.eos, phase_forwards=phases, fused_plan=fused))
                continue

            # 4. parallel completion: one row per selected slot, sharing the context KV
            seq.discard()
            fuse_completion = fuse and cfg.kv_cache == "reuse"
            rows, positions, eos_row, completion_forwards, fused_logits = yield from parallel_completion(
                seq, drafts, positions, verification.slot_accepted, with_next_plan if fuse_completion else None)
            phases["complete"] += completion_forwards

            # 5. commit every completed row with its own KV (or recompute it: the Table 8 ablation)
            keep = cut_after_first_eos(seq.is_eos(rows.flatten()))
            tokens, token_positions = rows.flatten()[keep], positions.flatten()[keep]
            if cfg.kv_cache == "recompute":
                seq.discard()
                request = Forward(tokens, token_positions, _zeros(tokens))
                fuse_recompute = fuse and eos_row is None
                logits = yield with_next_plan(request) if fuse_recompute else request
                fused_logits = logits[tokens.numel():] if fuse_recompute else None
                phases["complete"] += 1
            seq.commit(tokens, token_positions)
            committed = list(tokens.split([int(keep.view_as(rows)[r].sum()) for r in range(rows.shape[0])]))
            slots = slots[~torch.isin(slots, starts)]
            if eos_row is not None:
                slots, finished = slots[slots < starts[eos_row]], True
            elif fuse:
                next_plan = fused_logits
            seq.record(RoundTrace(seq.stats.rounds, block, masked_slots, planned,
                                  _slot_events(starts[: rows.shape[0]], committed), "parallel_completion",
                                  sum(phases.values()), eos_row is not None, phase_forwards=phases, fused_plan=fused))
        if finished:
            break
    seq.finish("eos" if finished else "length")


def parallel_completion(seq: Sequence, drafts: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor,
                        with_next_plan=None):
    """§3.4: complete every selected slot, each as its own row, until all positions are accepted.

    Returns (rows [r, k], positions [r, k], eos_row or None, forwards, next-plan logits or None). Rows after
    the first one holding an accepted EOS are dropped. On return the cache holds each row's own KV as
    pending entries. `with_next_plan` appends the fused plan's masks to every verify forward; the logits of
    the last one are returned (valid when every row is committed).
    """
    cfg, k = seq.cfg, seq.cfg.slot_size
    rows, tags = drafts.clone(), accepted.clone()
    groups = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
    shared, eos_row, forwards, fused_logits = 0, None, 0, None  # shared: cached prefix length common to all rows
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

        # verify: AR probabilities of the filled window; keep its KV
        request = Forward(window.flatten(), window_positions.flatten(), window_groups.flatten())
        logits = yield with_next_plan(request) if with_next_plan else request
        forwards += 1
        logits, fused_logits = logits[: window.numel()], logits[window.numel():]
        probs = shifted_token_probs(logits.view(*window.shape, -1), window)
        accept = force_progress(probs > cfg.token_threshold, window_tags)
        tags[:, shared:] = accepted_prefix(accept)

        # EOS: keep rows up to the first one with an accepted EOS, which is complete
        hits = (seq.is_eos(rows[:, shared:]) & tags[:, shared:].bool()).any(1)
        if bool(hits.any()):
            eos_row = int(hits.nonzero()[0])
            rows, tags, positions = rows[: eos_row + 1], tags[: eos_row + 1], positions[: eos_row + 1]
            tags[eos_row] = 1

        shared += shared_advance(tags[:, shared:], bool(tags.all()))
        seq.retain(positions[:, :shared].flatten())
    if shared != k:
        raise RuntimeError(f"parallel completion ended with {shared} of {k} positions shared")
    return rows, positions, eos_row, forwards, fused_logits


# --------------------------------------------------------------------------------- speculative (exact)
def speculative_program(seq: Sequence) -> Program:
    """Masked drafts verified by the model's own AR predictions: the output is AR decoding's, token for token.

    Every forward carries the next token (already decided by the previous forward's AR logits) and the
    drafts after it, followed by masks that draft the tokens after the next one. The drafts are accepted
    while they agree with the AR predictions (greedy), or by the speculative-sampling rule (temperature > 0);
    the AR prediction after the last accepted draft is the next forward's first token, so every forward
    commits at least one token. A single chain of masks (after the drafts) drafts only when every draft
    is accepted; `cfg.predraft` adds one chain of masks per possible acceptance length. With
    `cfg.lookup_length`, a round whose last tokens occurred earlier in the text verifies the tokens that followed
    them instead (prompt lookup), without masks; with `cfg.table_length`, a round with nothing to copy verifies
    what the model's draft table says usually follows, also without masks.
    """
    cfg, device = seq.cfg, seq.device
    prompt_length, draft_length = seq.prompt_length, cfg.draft_length
    end = prompt_length + cfg.max_new_tokens  # positions of the response are < end

    def draft_masks(after: int) -> torch.Tensor:
        """Positions of the masks that draft the tokens after position `after` + 1 (the first mask stands
        for the token the AR logits give at `after` + 1 and drafts nothing)."""
        stop = max(after + 1, min(after + 2 + draft_length, end)) if draft_length else after + 1  # d 0: no masks
        return torch.arange(after + 1, stop, device=device)

    def drafts_from(mask_logits: torch.Tensor) -> Drafts:
        drafts = draft_tokens_from_masks(mask_logits, cfg.temperature, seq.generator)
        return confident_drafts(drafts, mask_logits, cfg.draft_threshold)

    logits = yield _prefill(seq, draft_masks(prompt_length - 1), logits_from=prompt_length - 1)
    seq.commit(seq.prompt, torch.arange(prompt_length, device=device))
    token = next_token(logits[0], cfg.temperature, seq.generator)  # the token at `position`
    drafts = drafts_from(logits[2:])
    position, phases = prompt_length, {"prefill": 1}  # the first round also accounts for the prefill
    text = seq.prompt.tolist()  # prompt and committed response: what prompt lookup searches
    while True:
        eos = bool(seq.is_eos(token))
        if eos or position == end - 1:  # the last token needs no forward
            seq.commit(token, torch.tensor([position], device=device), cached=False)
            seq.record(RoundTrace(seq.stats.rounds, 0, [], [], [SlotEvent(position, token.tolist())],
                                  "speculative", sum(phases.values()), eos, phase_forwards=phases))
            seq.finish("eos" if eos else "length")
            return
        phases["verify"] = phases.get("verify", 0) + 1
        so_far = text + token.tolist()
        copied = text_drafts(so_far, cfg.lookup_length, cfg.table_length, seq.draft_table)
        if copied:
            drafts = copied_drafts(copied, logits.shape[-1], cfg.temperature, device)
        drafts = drafts[: end - 1 - position]
        n = drafts.tokens.numel()
        chain = torch.cat([token, drafts.tokens])
        chain_positions = torch.arange(position, position + n + 1, device=device)
        request = Forward(chain, chain_positions, _zeros(chain))
        branches = []  # (acceptance length, mask positions) of each chain of masks, in request order
        # a forward that verifies a copy carries no masks: the copy usually goes on, and without mask rows the
        # forward is narrower and skips a mask-gated adapter entirely
        for length in [] if copied else range(n, -1, -1) if cfg.predraft else [n]:
            masks = draft_masks(position + length)  # group n - length + 1 reads the chain up to its length-th draft
            if masks.numel() > 1:
                request = request.with_branch(_masks(seq, masks), masks, n - length + 1, position + length)
                branches.append((length, masks))
        logits = yield request

        accepted, following = accept_drafts(drafts, logits[: n + 1], cfg.temperature, seq.generator)
        tokens = chain[: accepted + 1]
        eos = seq.is_eos(tokens)
        if bool(eos.any()):
            tokens = tokens[cut_after_first_eos(eos)]
        seq.commit(tokens, chain_positions[: tokens.numel()], group=0)  # pre-drafts may share positions
        text += tokens.tolist()
        done = bool(eos.any())
        seq.record(RoundTrace(seq.stats.rounds, 0, [],
                              [SlotEvent(position + 1, drafts.tokens.tolist())] if n else [],
                              [SlotEvent(position, tokens.tolist())], "speculative", sum(phases.values()), done,
                              phase_forwards=phases, drafted=n, accepted=min(accepted, tokens.numel() - 1)))
        phases = {}
        position += accepted + 1
        if done or position == end:
            seq.finish("eos" if done else "length")
            return
        token = following
        offset = n + 1
        drafts = Drafts.none(device)
        for branch_accepted, masks in branches:
            if branch_accepted == accepted:
                drafts = drafts_from(logits[offset + 1: offset + masks.numel()])
            offset += masks.numel()


# --------------------------------------------------------------------------------- autoregressive
def autoregressive_program(seq: Sequence) -> Program:
    """The baseline: one token per forward on the same engine (greedy, or sampled at temperature > 0)."""
    cfg, device = seq.cfg, seq.device
    prompt_length = seq.prompt_length
    logits = yield _prefill(seq, torch.empty(0, dtype=torch.long, device=device), logits_from=prompt_length - 1)
    seq.commit(seq.prompt, torch.arange(prompt_length, device=device))
    for i in range(cfg.max_new_tokens):
        token = next_token(logits[-1], cfg.temperature, seq.generator)
        position = torch.tensor([prompt_length + i], device=device)
        eos = bool(seq.is_eos(token))
        last = eos or i == cfg.max_new_tokens - 1
        if not last:
            logits = yield Forward(token, position, torch.zeros_like(position))
        seq.commit(token, position, cached=not last)  # the last token needs no forward
        seq.record(RoundTrace(seq.stats.rounds, 0, [], [], [SlotEvent(int(position), token.tolist())],
                              "autoregressive", 1, eos, phase_forwards={"prefill" if i == 0 else "decode": 1}))
        if last:
            seq.finish("eos" if eos else "length")
            return


PROGRAMS = {"refusion": refusion_program, "speculative": speculative_program,
            "autoregressive": autoregressive_program}
