"""Sampling keyed by position: the noise that decides the token at a response position depends on the sequence's
seed and that position alone (`PositionNoise`), never on how many draws were made before it.

AR decoding and the exact mode sample every token by Gumbel-max, argmax(logits / T + G), with G drawn from a
generator seeded by (seed, position) (`position_seed`). Gumbel-max is an exact sample of softmax(logits / T), and
the noise of each position is its own, so the text is AR sampling's in distribution; and since the noise of a
position does not depend on what was drafted, verified or batched before it, the same seed gives the same text
whatever the sequence shares its steps with and however many drafts each step verifies (the exact mode's text at
temperature > 0 is AR decoding's at the same seed, token for token, as it is at temperature 0).
Plan and infill keeps its own sequential generator (its plan redraws the same positions round after round).
"""

from __future__ import annotations

import torch

from refusion.decode.plan import greedy

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The 63-bit seed of the draw at `position` of a sequence seeded with `seed`: splitmix64 of the pair, so nearby
    seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class PositionNoise:
    """The Gumbel noise of each response position of one sequence, drawn on `device` from (seed, position)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.seed = int(seed)
        self.generator = torch.Generator(device=device)
        self.device = self.generator.device

    def gumbel(self, start: int, count: int, vocab_size: int) -> torch.Tensor:
        """[count, vocab_size] float32 standard Gumbel noise of positions start .. start + count - 1."""
        tiny = torch.finfo(torch.float32).tiny
        rows = []
        for position in range(start, start + count):
            self.generator.manual_seed(position_seed(self.seed, position))
            rows.append(torch.rand(vocab_size, generator=self.generator, dtype=torch.float32, device=self.device))
        u = torch.stack(rows) if rows else torch.empty(0, vocab_size, device=self.device)
        return -torch.log(-torch.log(u.clamp(tiny, 1.0 - 1e-7)))


def decided_tokens(logits: torch.Tensor, temperature: float, noise: PositionNoise | None,
                   start: int) -> torch.Tensor:
    """[n, V] logits of positions start .. start + n - 1 -> [n] the token each decides: the argmax at temperature 0,
    else the Gumbel-max sample with each position's own noise."""
    return greedy(sampling_scores(logits, temperature, noise, start))


def sampling_scores(logits: torch.Tensor, temperature: float, noise: PositionNoise | None,
                    start: int) -> torch.Tensor:
    """[n, V] logits of positions start .. start + n - 1 -> [n, V] scores whose argmax is each position's token:
    the logits themselves at temperature 0, else logits / T plus each position's Gumbel noise."""
    if temperature <= 0:
        return logits
    if noise is None:
        raise ValueError("sampling at temperature > 0 needs the sequence's PositionNoise")
    gumbel = noise.gumbel(start, logits.shape[0], logits.shape[-1]).to(logits.device, non_blocking=True)
    return logits.float() / temperature + gumbel
