"""The model's draft table as a drafter: what the model's own answers usually write after the text's last tokens
(`DecodeConfig.table_length`, `model/draft_table.py`), with a second chain from each run's runner-up follower."""

from __future__ import annotations

from refusion.decode.costs import AcceptanceByDepth, AcceptanceByFrequency, chances
from refusion.decode.drafters.base import DraftContext, Drafter, Proposal, Verdict
from refusion.decode.speculate import copied_drafts
from refusion.model.draft_table import DraftTable


def runner_up_drafts(text: list[int], table: DraftTable | None, length: int) -> list[int]:
    """A second chain from the draft table, verified beside its first one in the same forward: the token that
    second most often followed the run the table's chain starts from, then what the table says follows it (up to
    `length` tokens); [] when that run had no other follower. It starts where the first chain's first draft
    stands, so at most one of the two is accepted past that point."""
    second = table.runner_up(text) if table is not None and length else None
    return [] if second is None else [second, *table.drafts([*text, second], length - 1)]


class TableDrafter(Drafter):
    """Up to `length` tokens walked from the draft table, and (`runner_up`) a second chain from the runner-up
    follower of the run the walk starts from, for a sequence decoded alone.

    The second chain is verified without a grammar (which masks one chain), and alone: a batch's steps are its slowest sequence's, and at batch 4 on the
    held-out groups the second chain saved no forward (docs/archive/RESULTS-LEDGER.md: *Runner-up chains*)."""

    name = "table"

    def __init__(self, table: DraftTable, length: int, device="cpu", runner_up: bool = True,
                 acceptance: AcceptanceByFrequency | None = None):
        """`acceptance`: the record its drafts' verdicts go to and are priced by, which may be shared with other
        sequences' drafters (a decoder's: `Decoder.table_acceptance`); None: its own."""
        self.table, self.length, self.device, self.runner_up = table, length, device, runner_up
        self.acceptance = AcceptanceByFrequency() if acceptance is None else acceptance
        self.runner_up_acceptance = AcceptanceByDepth()  # of its second chains
        self.frequencies: list[float] = []  # of the drafts of its last proposal

    @staticmethod
    def for_sequence(seq) -> TableDrafter | None:
        """The sequence's draft table (None: `cfg.table_length` is 0 or the model has no table)."""
        cfg = seq.cfg
        if not cfg.table_length or seq.draft_table is None:
            return None
        return TableDrafter(seq.draft_table, cfg.table_length, seq.device,
                            runner_up=seq.grammar is None, acceptance=seq.table_acceptance)

    def propose(self, context: DraftContext) -> Proposal:
        walked = self.table.walk(context.text, self.length)
        if not walked:
            return Proposal.none(self.device)
        copied, self.frequencies = [token for token, _ in walked], [frequency for _, frequency in walked]
        second = ()
        if self.runner_up and context.batch == 1:
            second = tuple(runner_up_drafts(context.text, self.table, min(self.length, context.room)))
        return Proposal(self, copied_drafts(copied, self.device), tuple(self.acceptance.chances(self.frequencies)),
                        second, tuple(chances(len(second), self.runner_up_acceptance)))

    def bound(self, room: int, batch: int) -> tuple[int, float]:
        """Up to `length` drafts, and as many in a second chain where one is drafted (`batch` 1), each worth at most
        the highest chance of a single draft."""
        length, second = min(self.length, room), self.runner_up and batch == 1
        gain = max(self.acceptance.highest(), self.runner_up_acceptance.rate(1) if second else 0.0)
        return length * (1 + second), gain

    def observe(self, verdict: Verdict) -> None:
        proposal = verdict.proposal
        if proposal.drafter is not self:
            return
        if drafted := proposal.drafts.tokens.numel():
            self.acceptance.record(self.frequencies[:drafted], verdict.accepted)
        if proposal.second:
            self.runner_up_acceptance.record(len(proposal.second), verdict.on_second)
