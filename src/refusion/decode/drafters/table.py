"""The model's draft table as a drafter: what the model's own answers usually write after the text's last tokens
(`DecodeConfig.table_length`, `model/draft_table.py`), with a second chain from each run's runner-up follower."""

from __future__ import annotations

from refusion.decode.acceptance import AcceptanceByDepth, AcceptanceByFrequency, chances
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

    A sequence decoded alone prices each draft by the frequency the table states for it (`by_frequency`); in a batch
    its chains are priced by depth (`by_depth`), as every chain was before: at 8 sequences on E5 (int4-q8) the
    frequencies made the step verify drafts that lost, ~1.6 s over a ~24 s run for 7 fewer steps
    (docs/archive/BENCHMARKS-JOURNAL.md: *The table's drafts priced by frequency*). The second chain is
    verified without a grammar (which masks one chain), and alone: a batch's steps are its slowest sequence's, and
    at batch 4 on the held-out groups it saved no forward (docs/archive/RESULTS-LEDGER.md: *Runner-up chains*)."""

    name = "table"

    def __init__(self, table: DraftTable, length: int, device="cpu", runner_up: bool = True,
                 by_frequency: AcceptanceByFrequency | None = None):
        """`by_frequency`: the record its drafts' verdicts go to and are priced by when its sequence decodes alone,
        which may be shared with other sequences' drafters (a decoder's: `Decoder.table_acceptance`); None: its
        own."""
        self.table, self.length, self.device, self.runner_up = table, length, device, runner_up
        self.by_frequency = AcceptanceByFrequency() if by_frequency is None else by_frequency
        self.by_depth = AcceptanceByDepth()  # of its chains, in this sequence
        self.runner_up_acceptance = AcceptanceByDepth()  # of its second chains
        self.frequencies: list[float] = []  # of the drafts of its last proposal

    @staticmethod
    def for_sequence(seq) -> TableDrafter | None:
        """The sequence's draft table (None: `cfg.table_length` is 0 or the model has no table)."""
        cfg = seq.cfg
        if not cfg.table_length or seq.draft_table is None:
            return None
        return TableDrafter(seq.draft_table, cfg.table_length, seq.device,
                            runner_up=seq.grammar is None, by_frequency=seq.table_acceptance)

    def propose(self, context: DraftContext) -> Proposal:
        walked = self.table.walk(context.text, self.length)
        if not walked:
            return Proposal.none(self.device)
        copied, self.frequencies = [token for token, _ in walked], [frequency for _, frequency in walked]
        alone = context.batch == 1
        priced = self.by_frequency.chances(self.frequencies) if alone else chances(len(copied), self.by_depth)
        second = ()
        if self.runner_up and alone:
            second = tuple(runner_up_drafts(context.text, self.table, min(self.length, context.room)))
        return Proposal(self, copied_drafts(copied, self.device), tuple(priced),
                        second, tuple(chances(len(second), self.runner_up_acceptance)))

    def bound(self, room: int, batch: int) -> tuple[int, float]:
        """Up to `length` drafts, and as many in a second chain where one is drafted (`batch` 1), each worth at most
        the highest chance of a single draft (alone: of any tenth of frequency; in a batch: a chain's first)."""
        length, alone = min(self.length, room), batch == 1
        gain = self.by_frequency.highest() if alone else self.by_depth.rate(1)
        if self.runner_up and alone:
            gain = max(gain, self.runner_up_acceptance.rate(1))
        return length * (1 + (self.runner_up and alone)), gain

    def observe(self, verdict: Verdict) -> None:
        proposal = verdict.proposal
        if proposal.drafter is not self:
            return
        if drafted := proposal.drafts.tokens.numel():
            self.by_frequency.record(self.frequencies[:drafted], verdict.accepted)
            self.by_depth.record(drafted, verdict.accepted)
        if proposal.second:
            self.runner_up_acceptance.record(len(proposal.second), verdict.on_second)
