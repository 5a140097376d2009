"""TEMPORARY: the exact mode's program before its drafters moved to `decode/drafters/` (pins the refactor).

The exact mode (`strategy="speculative"`): drafts verified by the model's own AR predictions, so the output is AR
decoding's, token for token, while a forward can commit several tokens (docs/DECODING.md, "The exact mode").

Every forward carries the next token (already decided by the previous forward's AR logits) and the drafts after
it (the chain), followed by chains of masks that draft the tokens after the next one, or by a second chain of drafts
for the same positions (the draft table's runner-up). `DraftingLayout` builds that
forward and reads its logits back, so the layout lives in one place.
"""

from __future__ import annotations

import torch

from refusion.decode.costs import AcceptanceByDepth, best_draft_count, expected_tokens
from refusion.decode.drafters.masks import confident_drafts, draft_tokens_from_masks
from refusion.decode.drafters.prompt_lookup import lookup_drafts
from refusion.decode.drafters.table import runner_up_drafts
from refusion.decode.logprobs import TokenLogprobs
from refusion.decode.outputs import RoundTrace, SlotEvent
from refusion.decode.plan import next_token
from refusion.decode.programs.speculative import DraftingLayout
from refusion.decode.sequence import Program, Sequence
from refusion.decode.speculate import Drafts, accept_drafts, copied_drafts


def text_drafts(text, lookup_length, table_length, table):
    copied = lookup_drafts(text, lookup_length) if lookup_length else []
    if copied:
        return copied, "lookup"
    if table_length and table is not None:
        copied = table.drafts(text, table_length)
    return copied, "table" if copied else ""


def speculative_program_before(seq: Sequence) -> Program:
    """Masked drafts verified by the model's own AR predictions: the output is AR decoding's, token for token.

    The drafts are accepted while they agree with the AR predictions (greedy), or by the speculative-sampling rule
    (temperature > 0); the AR prediction after the last accepted draft is the next forward's first token, so every
    forward commits at least one token. A single chain of masks (after the drafts) drafts only when every draft
    is accepted; `cfg.predraft` adds one chain of masks per possible acceptance length. With
    `cfg.lookup_length`, a round whose last tokens occurred earlier in the text verifies the tokens that followed
    them instead (prompt lookup), without masks; with `cfg.table_length`, a round with nothing to copy verifies
    what the model's draft table says usually follows, also without masks, and (greedy) a second chain beside it
    from the table's runner-up follower (`speculate.runner_up_drafts`). Where the model's forward costs were
    measured (`ModelSetup.forward_costs`), a round verifies only as many copied drafts as pay for the wider forward
    at the acceptance this sequence has seen from their source (`decode.costs`).
    """
    cfg, device = seq.cfg, seq.device
    prompt_length, draft_length = seq.prompt_length, cfg.draft_length
    end = prompt_length + cfg.max_new_tokens  # positions of the response are < end

    def draft_masks(after: int) -> torch.Tensor:
        """Positions of the masks that draft the tokens after position `after` + 1 (the first mask stands
        for the token the AR logits give at `after` + 1 and drafts nothing)."""
        stop = max(after + 1, min(after + 2 + draft_length, end)) if draft_length else after + 1  # d 0: no masks
        return torch.arange(after + 1, stop, device=device)

    def drafts_from(mask_logits: torch.Tensor | None) -> Drafts:
        if mask_logits is None:
            return Drafts.none(device)
        drafts = draft_tokens_from_masks(mask_logits, cfg.temperature, seq.generator)
        return confident_drafts(drafts, mask_logits, cfg.draft_threshold).on_host()

    request, layout = DraftingLayout.prefill(seq, draft_masks(prompt_length - 1))
    logits = yield request
    seq.commit(seq.prompt, torch.arange(prompt_length, device=device))
    first = layout.chain_logits(logits)[0]
    allowed = first if seq.grammar is None else seq.grammar.mask(first)  # structured output
    token = next_token(allowed, cfg.temperature, seq.generator)  # the token at `position`
    token_id = int(token)  # on the host: every later round's comes with its acceptance
    token_logprobs = seq.logprobs_of(layout.chain_logits(logits)[:1], token)  # None unless cfg.logprobs
    drafts = drafts_from(layout.draft_logits(logits, 0))
    position, phases = prompt_length, {"prefill": 1}  # the first round also accounts for the prefill
    text = seq.prompt.tolist()  # prompt and committed response: what prompt lookup searches
    acceptance: dict[str, AcceptanceByDepth] = {}  # by draft source ("lookup", "table"): for the cost-aware cut
    while True:
        eos = seq.is_eos_id(token_id)
        if eos or position == end - 1:  # the last token needs no forward
            seq.commit(token, torch.tensor([position], device=device), cached=False, logprobs=token_logprobs)
            seq.record(RoundTrace(index=seq.stats.rounds, block=0, masked_slots=[], planned=[],
                                  committed=[SlotEvent(position, [token_id])], how="speculative",
                                  forwards=sum(phases.values()), finished=eos, phase_forwards=phases))
            seq.finish("eos" if eos else "length")
            return
        phases["verify"] = phases.get("verify", 0) + 1
        copied, source = text_drafts(text + [token_id], cfg.lookup_length, cfg.table_length, seq.draft_table)
        if copied:
            drafts = copied_drafts(copied, logits.shape[-1], cfg.temperature, device)
        drafts = drafts[: end - 1 - position]
        if seq.grammar is not None:  # structured output: verify only drafts the grammar allows after the token
            seq.grammar.consume([token_id])
            drafts = drafts[: seq.grammar.valid_prefix(list(drafts.ids))]
        record = acceptance.setdefault(source, AcceptanceByDepth()) if copied else None
        if record is not None and seq.forward_costs is not None and drafts.tokens.numel():  # those that pay
            drafts = drafts[: best_draft_count(drafts.tokens.numel(), record, seq.forward_costs,
                                               batch=seq.cache.batch_size)]
        n = drafts.tokens.numel()
        # greedy, a table's round of a sequence decoded alone: the runner-up chain beside the table's own
        # (`speculate.runner_up_drafts`); in a batch, whose steps are its slowest sequence's, it saved no forward
        # (docs/BENCHMARKS.md, Current results: *Runner-up chains*)
        second = []
        if source == "table" and cfg.temperature <= 0 and seq.grammar is None and seq.cache.batch_size == 1:
            second = runner_up_drafts(text + [token_id], seq.draft_table, min(cfg.table_length, end - 1 - position))
        second_record = acceptance.setdefault("runner_up", AcceptanceByDepth()) if second else None
        if second and seq.forward_costs is not None:
            second = second[: best_draft_count(len(second), second_record, seq.forward_costs, width=n + 1,
                                               committed=1 + expected_tokens(n, record))]
        chain = torch.cat([token, drafts.tokens])
        second_tokens = torch.tensor(second, dtype=torch.long, device=device) if second else None
        # a forward that verifies a copy carries no masks: the copy usually goes on, and without mask rows the
        # forward is narrower and skips a mask-gated adapter entirely
        lengths = [] if copied else range(n, -1, -1) if cfg.predraft else [n]
        branches = [(length, m) for length in lengths if (m := draft_masks(position + length)).numel() > 1]
        request, layout = DraftingLayout.verify(seq, chain, position, branches, second_tokens)
        logits = yield request

        ar_rows = layout.chain_logits(logits)
        verifying = ar_rows
        if seq.grammar is not None:  # each row masked by the grammar state after the chain tokens before it
            verifying = seq.grammar.mask_chain(verifying, list(drafts.ids))
        accepted, following, following_id = accept_drafts(drafts, verifying, cfg.temperature, seq.generator)
        if record is not None and n:
            record.record(n, accepted)
        # the accepted drafts, and the AR rows that predict each of them and the following token (row i of the
        # chain predicts its token i + 1; unmasked by a grammar: the logprobs are the model's)
        path, path_ids, rows = drafts.tokens[:accepted], list(drafts.ids[:accepted]), ar_rows[: accepted + 1]
        groups = 0  # pre-drafts may share positions
        if second:
            on_second = 0
            if accepted == 0 and following_id == second[0]:  # AR's token is the runner-up: its chain goes on
                second_rows = layout.second_logits(logits)
                more, following, following_id = accept_drafts(copied_drafts(second[1:], logits.shape[-1], 0.0, device),
                                                              second_rows, 0.0, seq.generator)
                on_second = 1 + more
                path, path_ids = second_tokens[:on_second], second[:on_second]
                rows = torch.cat([ar_rows[:1], second_rows[:on_second]])
                groups = torch.tensor([0] + [1] * on_second, device=device)
            second_record.record(len(second), on_second)
            accepted = max(accepted, on_second)
        if seq.grammar is not None:
            seq.grammar.consume(path_ids)
        tokens = torch.cat([token, path])
        # logprobs: the next token's from the forward that decided it, each accepted draft's and the following
        # token's from this forward's AR rows
        verified = seq.logprobs_of(rows, torch.cat([path, following]))
        logprobs = None if verified is None else TokenLogprobs.cat([token_logprobs, verified[:accepted]])
        committed = [token_id, *path_ids]
        cut = next((i + 1 for i, t in enumerate(committed) if seq.is_eos_id(t)), None)  # just after the first EOS
        done = cut is not None
        if done:
            tokens, committed, logprobs = tokens[:cut], committed[:cut], None if logprobs is None else logprobs[:cut]
            groups = groups if isinstance(groups, int) else groups[:cut]
        seq.commit(tokens, torch.arange(position, position + tokens.numel(), device=device), group=groups,
                   logprobs=logprobs)
        text += committed
        seq.record(RoundTrace(index=seq.stats.rounds, block=0, masked_slots=[],
                              planned=[SlotEvent(position + 1, list(d)) for d in (drafts.ids, second) if d],
                              committed=[SlotEvent(position, committed)], how="speculative",
                              forwards=sum(phases.values()), finished=done, phase_forwards=phases,
                              drafted=n + len(second), accepted=min(accepted, tokens.numel() - 1)))
        phases = {}
        position += accepted + 1
        if done or position == end:
            seq.finish("eos" if done else "length")
            return
        token, token_id, token_logprobs = following, following_id, None if verified is None else verified[accepted:]
        drafts = drafts_from(layout.draft_logits(logits, accepted))
