"""The exact mode (`strategy="speculative"`): drafts verified by the model's own AR predictions, so the output is AR
decoding's, token for token, while a forward can commit several tokens (docs/DECODING.md, "The exact mode").

The drafts come from the sequence's drafters (`decode/drafters/`: prompt lookup, the draft table, the masks), each
behind one interface; the program is a loop of rounds that asks them for a proposal, cuts it to the room left and
the grammar, offers it to the step's decision where forward costs were measured (`DraftOffer`: the loop decides for
the whole batch how far each sequence drafts, `costs.draft_counts`; before that, `DraftBound`: whether any draft of
the step could pay at all, else no drafter is asked), verifies what was kept
(`speculate.accept_drafts`) and tells every drafter the verdict. Every forward carries the next token (already decided by the previous forward's AR logits) and
the drafts after it (the chain), followed by the rows the proposing drafter adds (chains of masks that draft the
tokens after the next one), or by a second chain of drafts for the same positions (the draft table's runner-up).
`DraftingLayout` builds that forward and reads its logits back, so the layout lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refusion.decode.drafters import (
    DraftContext,
    Drafter,
    Proposal,
    Verdict,
    draft_bound,
    drafters_for,
    propose,
)
from refusion.decode.logprobs import TokenLogprobs
from refusion.decode.outputs import RoundTrace, SlotEvent
from refusion.decode.sampling import decided_tokens
from refusion.decode.sequence import DraftBound, DraftOffer, Forward, Program, Sequence, masks, prefill, zeros
from refusion.decode.speculate import Drafts, accept_drafts, copied_drafts


@dataclass(frozen=True)
class DraftingLayout:
    """Where the logits of one exact-mode forward are: first the chain's (the next token, then one per draft),
    then, for each acceptance length the forward drafts for, a chain of masks whose first mask stands for the token
    AR decoding gives after that many accepted drafts (it drafts nothing) and whose other masks draft the tokens
    after it."""

    chain_length: int
    """Logits rows of the chain: the next token plus the drafts (1 in the prefill: the prompt's last token)."""
    branches: tuple[tuple[int, int], ...] = ()
    """(acceptance length, masks) of each chain of masks, in forward order."""
    second_length: int = 0
    """Logits rows of the second chain (the draft table's runner-up and what follows it), right after the chain's;
    0: none. A forward with a second chain carries no masks."""

    @staticmethod
    def prefill(seq: Sequence, mask_positions: torch.Tensor) -> tuple[Forward, DraftingLayout]:
        """The first forward: the prompt, then masks drafting the tokens after the first response token (one
        group; logits from the prompt's last token on)."""
        request = prefill(seq, mask_positions, logits_from=seq.prompt_length - 1)
        return request, DraftingLayout(1, ((0, mask_positions.numel()),))

    @staticmethod
    def verify(seq: Sequence, chain: torch.Tensor, position: int, branches: list[tuple[int, torch.Tensor]],
               second: torch.Tensor | None = None) -> tuple[Forward, DraftingLayout]:
        """A verify forward: `chain` (the next token and its drafts) at `position` onwards as group 0; each branch
        (acceptance length, mask positions) as group n - length + 1, reading the chain up to its length-th draft;
        or `second`, other drafts of the same positions as the chain's drafts, as group 1 reading the next token
        alone."""
        n = chain.numel() - 1
        request = Forward(chain, seq.position_ids(position, n + 1), zeros(chain))
        if second is not None and second.numel():
            if branches:
                raise ValueError("a forward with a second chain carries no masks")
            positions = seq.position_ids(position + 1, second.numel())
            return request.with_branch(second, positions, 1, position), DraftingLayout(n + 1, (), second.numel())
        for length, mask_positions in branches:
            request = request.with_branch(masks(seq, mask_positions), mask_positions, n - length + 1, position + length)
        return request, DraftingLayout(n + 1, tuple((length, m.numel()) for length, m in branches))

    def chain_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[chain_length, V]: row i is AR decoding's prediction after the chain's i-th token."""
        return logits[: self.chain_length]

    def second_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[second_length, V]: row i is AR decoding's prediction after the second chain's i-th token."""
        return logits[self.chain_length: self.chain_length + self.second_length]

    def draft_logits(self, logits: torch.Tensor, accepted: int) -> torch.Tensor | None:
        """[d, V] the logits of the masks that draft after `accepted` accepted drafts; None when the forward drafted
        for no such length."""
        offset = self.chain_length + self.second_length
        for length, count in self.branches:
            if length == accepted:
                return logits[offset + 1: offset + count]
            offset += count
        return None


def speculative_program(seq: Sequence) -> Program:
    """Drafts verified by the model's own AR predictions: the output is AR decoding's, token for token.

    The drafts are accepted while they equal the AR predictions: the argmax (greedy), or at temperature > 0 the
    sample with each position's own noise (`sampling.PositionNoise`, the same draw AR decoding makes at that position
    with the same seed); the AR prediction after the last accepted draft is the next forward's first token, so every
    forward commits at least one token. Each round verifies the first proposal of the sequence's drafters that has
    drafts (`drafters.propose`), as far as the step's decision takes it; every drafter then observes the verdict.
    """
    cfg, device = seq.cfg, seq.device
    prompt_length = seq.prompt_length
    end = prompt_length + cfg.max_new_tokens  # positions of the response are < end
    drafters = drafters_for(seq)
    nothing = Proposal.none(device)  # a round that drafts nothing (shared: a proposal is never changed in place)
    plain, group = DraftingLayout(1), torch.zeros(1, dtype=torch.long, device=device)  # such a round's layout

    # 1. prefill: the prompt, and the rows of the drafter that rides on forwards (masks drafting the first round)
    rider = next((d for d in drafters if d.rows(prompt_length - 1, 0)), None)
    rows = rider.rows(prompt_length - 1, 0) if rider is not None else []
    request, layout = DraftingLayout.prefill(seq, rows[0][1] if rows else torch.empty(0, dtype=torch.long,
                                                                                       device=device))
    logits = yield request
    seq.commit_prompt()
    first = layout.chain_logits(logits)[0]
    allowed = first if seq.grammar is None else seq.grammar.mask(first)  # structured output
    token = decided_tokens(allowed[None], cfg.temperature, seq.noise, prompt_length)  # [1] the token at `position`
    token_id = int(token)  # on the host: every later round's comes with its acceptance
    token_logprobs = seq.logprobs_of(layout.chain_logits(logits)[:1], token)  # None unless cfg.logprobs
    observe(drafters, Verdict(Proposal(rider, Drafts.none(device)), 0, rows=layout.draft_logits(logits, 0),
                              rows_start=prompt_length + 1))
    position, phases = prompt_length, {"prefill": 1}  # the first round also accounts for the prefill
    text = seq.prompt.tolist()  # prompt and committed response: what the drafters read
    while True:
        eos = seq.is_eos_id(token_id)
        if eos or position == end - 1:  # the last token needs no forward
            seq.commit(token, seq.position_ids(position, 1), cached=False, logprobs=token_logprobs, ids=[token_id])
            seq.record(RoundTrace(index=seq.stats.rounds, block=0, masked_slots=[], planned=[],
                                  committed=[SlotEvent(position, [token_id])], how="speculative",
                                  forwards=sum(phases.values()), finished=eos, phase_forwards=phases))
            seq.finish("eos" if eos else "length")
            return
        phases["verify"] = phases.get("verify", 0) + 1
        # 2. propose: the first drafter with drafts for the tokens after the next one, cut to what may be verified
        if seq.grammar is not None:
            seq.grammar.consume([token_id])
        room, batch = end - 1 - position, seq.cache.batch_size
        bound = draft_bound(drafters, room, batch) if seq.forward_costs is not None else None
        if bound is not None and not (yield DraftBound(*bound)):  # no draft of the step could pay: none asked for
            proposal, riding = nothing, []
        else:
            context = DraftContext(text + [token_id], room, batch)
            proposal = verifiable(seq, propose(drafters, context, position, device), room)
            riding = proposal.drafter.rows(position, proposal.drafts.tokens.numel()) if proposal.drafter else []
            if seq.forward_costs is not None and (proposal.drafted or proposal.second or riding):
                # what pays at the step's width, for the whole batch (`costs.draft_counts`)
                proposal, riding = taken(proposal, riding, (yield draft_offer(proposal, riding)))
        drafts, second = proposal.drafts, list(proposal.second)
        n = drafts.tokens.numel()
        chain = torch.cat([token, drafts.tokens]) if n else token
        second_tokens = torch.tensor(second, dtype=torch.long, device=device) if second else None
        if n or second or riding:
            request, layout = DraftingLayout.verify(seq, chain, position, riding, second_tokens)
        else:  # the next token alone, as AR decoding's step
            request, layout = Forward(token, seq.position_ids(position, 1), group), plain
        logits = yield request

        # 3. verify: AR decoding's acceptance of the chain (and of the second chain where the chain's first draft
        # failed); every drafter observes it
        ar_rows = layout.chain_logits(logits)
        verifying = ar_rows
        if seq.grammar is not None:  # each row masked by the grammar state after the chain tokens before it
            verifying = seq.grammar.mask_chain(verifying, list(drafts.ids))
        accepted, following, following_id = accept_drafts(drafts, verifying, cfg.temperature, seq.noise, position + 1)
        # the accepted drafts, and the AR rows that predict each of them and the following token (row i of the
        # chain predicts its token i + 1; unmasked by a grammar: the logprobs are the model's)
        path, path_ids, rows = drafts.tokens[:accepted], list(drafts.ids[:accepted]), ar_rows[: accepted + 1]
        groups, on_second = 0, 0  # pre-drafts may share positions
        if second and accepted == 0 and following_id == second[0]:  # AR's token is the runner-up: it goes on
            second_rows = layout.second_logits(logits)
            more, following, following_id = accept_drafts(copied_drafts(second[1:], device), second_rows,
                                                          cfg.temperature, seq.noise, position + 2)
            on_second = 1 + more
            path, path_ids = second_tokens[:on_second], second[:on_second]
            rows = torch.cat([ar_rows[:1], second_rows[:on_second]])
            groups = torch.tensor([0] + [1] * on_second, device=device)
        longest = max(accepted, on_second)
        observe(drafters, Verdict(proposal, accepted, on_second, layout.draft_logits(logits, longest),
                                  rows_start=position + longest + 2))

        # 4. commit: the next token and the accepted path, cut after the first EOS
        if seq.grammar is not None:
            seq.grammar.consume(path_ids)
        tokens = torch.cat([token, path]) if path.numel() else token
        # logprobs: the next token's from the forward that decided it, each accepted draft's and the following
        # token's from this forward's AR rows
        verified = seq.logprobs_of(rows, torch.cat([path, following])) if seq.wants_logprobs else None
        logprobs = None if verified is None else TokenLogprobs.cat([token_logprobs, verified[:longest]])
        committed = [token_id, *path_ids]
        cut = next((i + 1 for i, t in enumerate(committed) if seq.is_eos_id(t)), None)  # just after the first EOS
        done = cut is not None
        if done:
            tokens, committed, logprobs = tokens[:cut], committed[:cut], None if logprobs is None else logprobs[:cut]
            groups = groups if isinstance(groups, int) else groups[:cut]
        seq.commit(tokens, seq.position_ids(position, tokens.numel()), group=groups,
                   logprobs=logprobs, ids=committed)
        text += committed
        seq.record(RoundTrace(index=seq.stats.rounds, block=0, masked_slots=[],
                              planned=[SlotEvent(position + 1, list(d)) for d in (drafts.ids, second) if d],
                              committed=[SlotEvent(position, committed)], how="speculative",
                              forwards=sum(phases.values()), finished=done, phase_forwards=phases,
                              drafted=n + len(second), accepted=min(longest, tokens.numel() - 1)))
        phases = {}
        position += longest + 1
        if done or position == end:
            seq.finish("eos" if done else "length")
            return
        token, token_id, token_logprobs = following, following_id, None if verified is None else verified[longest:]


def observe(drafters: list[Drafter], verdict: Verdict) -> None:
    """Every drafter learns from the verdict."""
    for drafter in drafters:
        drafter.observe(verdict)


def verifiable(seq: Sequence, proposal: Proposal, room: int) -> Proposal:
    """The proposal cut to what the round may verify: no drafts past the response's end (`room`) and none the grammar
    forbids after the next token (structured output; the grammar has consumed it)."""
    count = min(proposal.drafts.tokens.numel(), room)
    if seq.grammar is not None:
        count = seq.grammar.valid_prefix(list(proposal.drafts[:count].ids))
    return proposal.cut(count)


def draft_offer(proposal: Proposal, rows: list[tuple[int, torch.Tensor]]) -> DraftOffer:
    """The proposal as the step's decision sees it: each draft of its chain, then each of its second chain (a row
    each, worth the chance its drafter gives that it and the drafts before it in its chain are accepted:
    `Proposal.chances`), then the rows its drafter adds (worth what they are expected to draft: `Drafter.rows_gain`)."""
    n = proposal.drafts.tokens.numel()
    items = [(1, c) for c in proposal.chain_chances()] + [(1, c) for c in proposal.second_chain_chances()]
    if rows:
        items.append((sum(m.numel() for _, m in rows), proposal.drafter.rows_gain(n)))
    return DraftOffer(1, tuple(items))


def taken(proposal: Proposal, rows: list[tuple[int, torch.Tensor]],
          count: int) -> tuple[Proposal, list[tuple[int, torch.Tensor]]]:
    """The proposal and rows cut to the first `count` items of its `draft_offer`."""
    n = proposal.drafts.tokens.numel()
    rows = rows if count > n + len(proposal.second) else []
    return proposal.cut(count, max(0, count - n)), rows
