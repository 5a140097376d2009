"""A slow, cache-free reference decoder: the oracle the fast engine must agree with.

Batch size 1, temperature 0, written independently of the engine (no shared helpers) and in the order of
docs/DECODING.md (paper §3). It keeps no KV cache: every forward re-reads the whole context. To stay equivalent to
KV reuse it tags every committed token with (round, row) and rebuilds the attention pattern that reuse
produces: a context token sees every earlier context token except those committed in the same round by
another row of parallel completion (rows never attend to each other). In "recompute" mode the rows of a
round count as one row, which is what recomputing their KV gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refusion.config import DecodeConfig
from refusion.decode.cache import attention_mask_dtype


class _Context:
    """Committed tokens in commit order, with their position ids and (round, row) tags."""

    def __init__(self, prompt: list[int]):
        self.tokens, self.positions = list(prompt), list(range(len(prompt)))
        self.rounds, self.rows = [0] * len(prompt), [0] * len(prompt)

    def add(self, tokens, positions, round_id: int, row: int) -> None:
        self.tokens += [int(t) for t in tokens]
        self.positions += [int(p) for p in positions]
        self.rounds += [round_id] * len(tokens)
        self.rows += [row] * len(tokens)


def _forward(model, ctx: _Context, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Logits of each row's tokens, each row placed after the whole context (rows are a batch)."""
    n = len(ctx.tokens)
    rounds, row_ids = torch.tensor(ctx.rounds), torch.tensor(ctx.rows)
    earlier = torch.ones(n, n, dtype=torch.bool).tril()
    context_visible = earlier & ((rounds[:, None] != rounds[None, :]) | (row_ids[:, None] == row_ids[None, :]))
    width = max(len(t) for t, _ in rows)
    device = next(model.parameters()).device
    ids = torch.zeros(len(rows), n + width, dtype=torch.long)
    pos = torch.zeros(len(rows), n + width, dtype=torch.long)
    mask = torch.zeros(len(rows), n + width, n + width, dtype=torch.bool)
    for r, (tokens, positions) in enumerate(rows):
        w = len(tokens)
        ids[r, :n], ids[r, n:n + w] = torch.tensor(ctx.tokens), torch.tensor(tokens)
        pos[r, :n], pos[r, n:n + w] = torch.tensor(ctx.positions), torch.tensor(positions)
        mask[r, :n, :n] = context_visible
        mask[r, n:n + w, :n] = True
        mask[r, n:n + w, n:n + w] = torch.ones(w, w, dtype=torch.bool).tril()
        mask[r, n + w:, n + w:] = torch.eye(width - w, dtype=torch.bool)  # padding sees itself only
    mask4 = mask[:, None].to(device)
    if (mask_dtype := attention_mask_dtype(model)) is not None:
        mask4 = torch.zeros(mask4.shape, dtype=mask_dtype, device=device).masked_fill(~mask4, torch.finfo(mask_dtype).min)
    logits = model(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=mask4, use_cache=False).logits
    return [logits[r, n:n + len(t)].float().cpu() for r, (t, _) in enumerate(rows)]


@torch.no_grad()
def reference_generate(model, prompt: list[int], cfg: DecodeConfig, mask_token_id: int, eos_token_ids: list[int]) -> list[int]:
    """Greedy ReFusion decoding of one prompt without a KV cache. Returns the response ids."""
    if cfg.temperature != 0 or cfg.strategy != "refusion":
        raise ValueError("the reference decoder covers strategy='refusion' at temperature 0 only")
    k, tau_slot, tau_token = cfg.slot_size, cfg.slot_threshold, cfg.token_threshold
    eos = torch.tensor(eos_token_ids, dtype=torch.long)
    prompt_len, gen_len = len(prompt), cfg.canvas_length
    ctx = _Context(prompt)
    round_id, eos_flag = 1, False
    for block_start in range(prompt_len, prompt_len + gen_len, cfg.block_size):
        block_end = min(block_start + cfg.block_size, prompt_len + gen_len)
        slot_starts = list(range(block_start, block_end, k))
        while slot_starts:
            # plan
            mask_pos = [s + i for s in slot_starts for i in range(k)]
            logits = _forward(model, ctx, [([mask_token_id] * len(mask_pos), mask_pos)])[0]
            probs = F.softmax(logits, -1)
            x0 = logits.argmax(-1)
            conf = probs.gather(-1, x0[:, None]).squeeze(-1).view(-1, k)
            x0 = x0.view(-1, k)
            picked = [i for i in range(len(slot_starts)) if conf[i, 0] > tau_slot] or [int(conf[:, 0].argmax())]
            drafts = x0[picked].clone()
            starts = [slot_starts[i] for i in picked]
            positions = torch.tensor([[s + i for i in range(k)] for s in starts])
            # global verification
            logits = _forward(model, ctx, [(drafts.flatten().tolist(), positions.flatten().tolist())])[0]
            logits = torch.cat([logits[:1], logits[:-1]])
            ar = F.softmax(logits, -1).gather(-1, drafts.flatten()[:, None]).squeeze(-1).view(-1, k)
            p = conf[picked].clone()
            p[:, 1:] = ar[:, 1:]
            ok = p > tau_token
            ok[:, 0] = True
            tags = torch.cumprod(ok.long(), 1)
            prefix_len = int(torch.cumprod(ok.flatten().long(), 0).sum())
            prefix = drafts.flatten()[:prefix_len]
            is_eos = torch.isin(prefix, eos)
            if is_eos.any() or prefix_len >= k:
                if is_eos.any():
                    first = int(is_eos.nonzero()[0])
                    n_commit, last_len = first // k + 1, first % k + 1
                else:
                    n_commit, last_len = prefix_len // k, k
                keep = (n_commit - 1) * k + last_len
                ctx.add(drafts[:n_commit].flatten()[:keep], positions[:n_commit].flatten()[:keep], round_id, 0)
                gone = set(starts[:n_commit])
                if is_eos.any():
                    eos_flag = True
                    gone |= {s for s in slot_starts if s >= starts[n_commit - 1]}
                slot_starts = [s for s in slot_starts if s not in gone]
                round_id += 1
                continue
            # parallel iterative completion
            blocks, accepted, eos_row = drafts.clone(), 0, None
            for _ in range(k):
                if bool((tags == 1).all()):
                    break
                prefix_rows = [(blocks[r, :accepted].tolist(), positions[r, :accepted].tolist()) for r in range(len(blocks))]
                window = blocks[:, accepted:]
                window_tags = tags[:, accepted:]
                masked = torch.where(window_tags.bool(), window, mask_token_id)
                rows = [(pre[0] + masked[r].tolist(), pre[1] + positions[r, accepted:].tolist())
                        for r, pre in enumerate(prefix_rows)]
                out = _forward(model, ctx, rows)
                proposed = torch.stack([o[accepted:] for o in out]).argmax(-1)
                window = torch.where(window_tags.bool(), window, proposed)
                blocks[:, accepted:] = window
                rows = [(pre[0] + window[r].tolist(), pre[1] + positions[r, accepted:].tolist())
                        for r, pre in enumerate(prefix_rows)]
                out = torch.stack([o[accepted:] for o in _forward(model, ctx, rows)])
                out = torch.cat([out[:, :1], out[:, :-1]], 1)
                got = F.softmax(out, -1).gather(-1, window[..., None]).squeeze(-1)
                ok = got > tau_token
                left = F.pad(window_tags, (1, 0), value=1)[:, :-1]
                ok[left == 1] = True
                tags[:, accepted:] = torch.cumprod(ok.long(), 1)
                hit = (torch.isin(blocks[:, accepted:], eos) & (tags[:, accepted:] == 1)).any(1)
                if hit.any():
                    eos_row = int(hit.nonzero()[0])
                    blocks, tags, positions = blocks[:eos_row + 1], tags[:eos_row + 1], positions[:eos_row + 1]
                    starts = starts[:eos_row + 1]
                    tags[eos_row] = 1
                least = int(tags[:, accepted:].sum(1).min())
                accepted += least - 1 if bool((tags == 0).any()) else least
            flat_eos = torch.isin(blocks.flatten(), eos).long()
            keep = ((torch.cumsum(flat_eos, 0) - flat_eos) == 0).view_as(blocks)
            for r in range(len(blocks)):
                row = 0 if cfg.kv_cache == "recompute" else r
                ctx.add(blocks[r][keep[r]], positions[r][keep[r]], round_id, row)
            gone = set(starts)
            if eos_row is not None:
                eos_flag = True
                gone |= {s for s in slot_starts if s >= starts[eos_row]}
            slot_starts = [s for s in slot_starts if s not in gone]
            round_id += 1
        if eos_flag:
            break
    order = sorted(range(len(ctx.tokens)), key=lambda i: ctx.positions[i])
    response = [ctx.tokens[i] for i in order if ctx.positions[i] >= prompt_len]
    cut = next((i + 1 for i, t in enumerate(response) if t in eos_token_ids), len(response))
    return response[:min(cut, cfg.max_new_tokens)]
