"""Decoding programs: the algorithm of one sequence, written as straight-line code.

A program is a generator. Each time it needs the model it yields a `Forward` (its new tokens, their
position ids and groups) and receives the logits of those tokens; the batching loop (`loop.py`) runs the
forwards of every live sequence of a batch together. Between forwards a program commits, retains or
discards its pending KV entries through `Sequence`, which owns its row of the `SlotCache`.

ReFusion (ALGORITHM.md §3): for each block, rounds of 1. plan, 2. verify, then 3. fast accept or
4. parallel completion, and 5. commit with KV reuse. The autoregressive baseline runs on the same engine.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

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
from refusion.decode.plan import gumbel_noise, plan_slots


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


Program = Generator[Forward, torch.Tensor, None]


class Sequence:
    """State of one sequence: prompt, committed tokens, settings, statistics and trace."""

    def __init__(self, seq_id: int, prompt: list[int], cfg: DecodeConfig, *, mask_token_id: int | None,
                 eos_token_ids: list[int], cache: SlotCache, device: torch.device,
                 generator: torch.Generator | None = None, trace: bool = False, on_round=None):
        self.id, self.cfg, self.cache, self.device = seq_id, cfg, cache, device
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
        self.program: Program = (autoregressive_program if cfg.strategy == "autoregressive" else refusion_program)(self)

    @property
    def prompt_length(self) -> int:
        return self.prompt.numel()

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.eos_ids)

    def commit(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Append tokens to the context; their pending KV entries become context (KV reuse)."""
        self.cache.commit(self.id, positions)
        self.committed_tokens.append(tokens)
        self.committed_positions.append(positions)

    def record(self, rnd: RoundTrace) -> None:
        self.stats.rounds += 1
        if self.rounds is not None:
            self.rounds.append(rnd)
        if self.on_round is not None:
            self.on_round(self, rnd)

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


def refusion_program(seq: Sequence) -> Program:
    cfg, k, device = seq.cfg, seq.cfg.slot_size, seq.device
    offsets = torch.arange(k, device=device)
    prompt_length = seq.prompt_length
    canvas_end = prompt_length + cfg.canvas_length
    first_round, finished = True, False
    for block, block_start in enumerate(range(prompt_length, canvas_end, cfg.block_size)):
        block_end = min(block_start + cfg.block_size, canvas_end)
        slots = torch.arange(block_start, block_end, k, device=device)  # starts of the masked slots
        while slots.numel():
            masked_slots, forwards = slots.tolist(), 0

            # 1. plan: draft every masked slot of the block on top of the context
            mask_positions = (slots[:, None] + offsets).flatten()
            masks = torch.full_like(mask_positions, seq.mask_token_id)
            if first_round:
                request = Forward(torch.cat([seq.prompt, masks]),
                                  torch.cat([torch.arange(prompt_length, device=device), mask_positions]),
                                  torch.zeros(prompt_length + masks.numel(), dtype=torch.long, device=device),
                                  logits_from=prompt_length)
            else:
                request = Forward(masks, mask_positions, torch.zeros_like(masks))
            logits = yield request
            forwards += 1
            if first_round:
                seq.commit(seq.prompt, torch.arange(prompt_length, device=device))
                first_round = False
            else:
                seq.cache.discard(seq.id)
            plan = plan_slots(logits, k, cfg.slot_threshold, cfg.temperature, seq.generator)
            selected = plan.selected
            drafts = plan.drafts[selected]  # [m, k]
            starts = slots[selected]
            positions = starts[:, None] + offsets  # [m, k]
            planned = _slot_events(starts, list(drafts), plan.scores[selected])

            # 2. verify: one forward of the selected drafts in position order, keeping its KV for now
            logits = yield Forward(drafts.flatten(), positions.flatten(), torch.zeros_like(drafts.flatten()))
            forwards += 1
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
                seq.record(RoundTrace(seq.stats.rounds, block, masked_slots, planned,
                                      _slot_events(starts[:n], committed), "fast_accept", forwards, accept.eos))
                continue

            # 4. parallel completion: one row per selected slot, sharing the context KV
            seq.cache.discard(seq.id)
            rows, positions, eos_row, completion_forwards = yield from parallel_completion(
                seq, drafts, positions, verification.slot_accepted)
            forwards += completion_forwards

            # 5. commit every completed row with its own KV (or recompute it: the Table 8 ablation)
            keep = cut_after_first_eos(seq.is_eos(rows.flatten()))
            tokens, token_positions = rows.flatten()[keep], positions.flatten()[keep]
            if cfg.kv_cache == "recompute":
                seq.cache.discard(seq.id)
                yield Forward(tokens, token_positions, torch.zeros_like(tokens))
                forwards += 1
            seq.commit(tokens, token_positions)
            committed = list(tokens.split([int(keep.view_as(rows)[r].sum()) for r in range(rows.shape[0])]))
            slots = slots[~torch.isin(slots, starts)]
            if eos_row is not None:
                slots, finished = slots[slots < starts[eos_row]], True
            seq.record(RoundTrace(seq.stats.rounds, block, masked_slots, planned,
                                  _slot_events(starts[: rows.shape[0]], committed), "parallel_completion",
                                  forwards, eos_row is not None))
        if finished:
            break


def parallel_completion(seq: Sequence, drafts: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor):
    """§3.4: complete every selected slot, each as its own row, until all positions are accepted.

    Returns (rows [r, k], positions [r, k], eos_row or None, forwards). Rows after the first one holding
    an accepted EOS are dropped. On return the cache holds each row's own KV as pending entries.
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
        seq.cache.retain(seq.id, positions[:, :shared].flatten())
        proposed = logits.argmax(-1).view_as(window)
        window = torch.where(window_tags, window, proposed)
        rows[:, shared:] = window

        # verify: AR probabilities of the filled window; keep its KV
        logits = yield Forward(window.flatten(), window_positions.flatten(), window_groups.flatten())
        forwards += 1
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
        seq.cache.retain(seq.id, positions[:, :shared].flatten())
    if shared != k:
        raise RuntimeError(f"parallel completion ended with {shared} of {k} positions shared")
    return rows, positions, eos_row, forwards


def autoregressive_program(seq: Sequence) -> Program:
    """The baseline: one token per forward on the same engine (greedy, or sampled at temperature > 0)."""
    cfg, device = seq.cfg, seq.device
    prompt_length = seq.prompt_length
    positions = torch.arange(prompt_length, device=device)
    logits = yield Forward(seq.prompt, positions, torch.zeros_like(positions), logits_from=prompt_length - 1)
    seq.commit(seq.prompt, positions)
    for i in range(cfg.max_new_tokens):
        token = next_token(logits[-1], cfg.temperature, seq.generator)
        position = torch.tensor([prompt_length + i], device=device)
        eos = bool(seq.is_eos(token))
        if eos or i == cfg.max_new_tokens - 1:
            seq.committed_tokens.append(token)  # no forward needed for the last token
            seq.committed_positions.append(position)
            seq.record(RoundTrace(seq.stats.rounds, 0, [], [], [SlotEvent(int(position), token.tolist())],
                                  "autoregressive", 1, eos))
            return
        logits = yield Forward(token, position, torch.zeros_like(position))
        seq.commit(token, position)
        seq.record(RoundTrace(seq.stats.rounds, 0, [], [], [SlotEvent(int(position), token.tolist())],
                              "autoregressive", 1, False))


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[V] -> [1]: argmax at temperature 0, else a Gumbel-max sample from softmax(logits / temperature)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    noisy = logits.double() / temperature + gumbel_noise(logits.shape, generator, logits.device)
    return noisy.argmax(-1, keepdim=True)
