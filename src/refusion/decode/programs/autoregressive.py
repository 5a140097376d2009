"""The autoregressive baseline: one token per forward on the same engine (greedy, or sampled at temperature > 0 with
each position's own noise, `sampling.PositionNoise`)."""

from __future__ import annotations

import torch

from refusion.decode.outputs import RoundTrace, SlotEvent
from refusion.decode.sampling import decided_tokens
from refusion.decode.sequence import Forward, Program, Sequence, prefill


def autoregressive_program(seq: Sequence) -> Program:
    """Prefill the prompt, then one forward per token until EOS or max_new_tokens (the last token needs none)."""
    cfg, device = seq.cfg, seq.device
    prompt_length = seq.prompt_length
    logits = yield prefill(seq, torch.empty(0, dtype=torch.long, device=device), logits_from=prompt_length - 1)
    seq.commit_prompt()
    group = torch.zeros(1, dtype=torch.long, device=device)
    for i in range(cfg.max_new_tokens):
        allowed = logits[-1] if seq.grammar is None else seq.grammar.mask(logits[-1])  # structured output
        token = decided_tokens(allowed[None], cfg.temperature, seq.noise, prompt_length + i)  # [1]
        logprobs = seq.logprobs_of(logits[-1:], token)  # None unless cfg.logprobs
        position = seq.position_ids(prompt_length + i, 1)
        token_ids = token.tolist()  # the one read back of a step
        eos = seq.is_eos_id(token_ids[0])
        last = eos or i == cfg.max_new_tokens - 1
        if seq.grammar is not None and not eos:
            seq.grammar.consume(token_ids)
        if not last:
            logits = yield Forward(token, position, group)
        seq.commit(token, position, cached=not last, logprobs=logprobs, ids=token_ids)
        seq.record(RoundTrace(index=seq.stats.rounds, block=0, masked_slots=[], planned=[],
                              committed=[SlotEvent(prompt_length + i, token_ids)], how="autoregressive",
                              forwards=1, finished=eos, phase_forwards={"prefill" if i == 0 else "decode": 1}))
        if last:
            seq.finish("eos" if eos else "length")
            return
