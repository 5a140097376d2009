"""Fixtures for decoding tests: a scripted-logit model that forces every branch of the algorithm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig

VOCAB = 32
MASK = 31
EOS = 2
FILLER = 3  # what an unscripted position predicts


class ScriptedLM(torch.nn.Module):
    """A model whose logits depend only on (input token, position id).

    * a mask token at position p predicts `masks[p] = (token, prob)`;
    * a clean token at position p predicts the token at p + 1 as `nexts[p + 1] = (token, prob)`.
    The named token gets `prob`, every other token shares the rest. It writes (zero) KV entries, so the
    engine's cache bookkeeping runs as with a real model.
    """

    def __init__(self, masks: dict[int, tuple[int, float]], nexts: dict[int, tuple[int, float]]):
        super().__init__()
        self.masks, self.nexts = masks, nexts
        self.config = PretrainedConfig(num_hidden_layers=1, vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS,
                                       max_position_embeddings=4096)
        self.config._attn_implementation = "sdpa"
        self.generation_config = SimpleNamespace(eos_token_id=EOS)
        self.embed = torch.nn.Embedding(VOCAB, 1)
        self.calls: list[tuple[list[int], list[int]]] = []

    def get_input_embeddings(self):
        return self.embed

    @property
    def dtype(self):
        return torch.float32

    def _dist(self, token: int, position: int) -> torch.Tensor:
        target, prob = self.masks.get(position, (FILLER, 0.5)) if token == MASK else self.nexts.get(position + 1, (FILLER, 0.5))
        probs = torch.full((VOCAB,), (1 - prob) / (VOCAB - 1))
        probs[target] = prob
        return probs.log()

    def forward(self, input_ids, position_ids, attention_mask=None, past_key_values=None, use_cache=False,
                logits_to_keep=0):
        batch, width = input_ids.shape
        if past_key_values is not None:
            zeros = torch.zeros(batch, 1, width, 1)
            past_key_values.update(zeros, zeros, 0)
        self.calls.append((input_ids.tolist(), position_ids.tolist()))
        logits = torch.stack([torch.stack([self._dist(int(t), int(p)) for t, p in zip(row, pos)])
                              for row, pos in zip(input_ids, position_ids)])
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


@pytest.fixture
def scripted():
    return ScriptedLM
