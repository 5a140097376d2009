"""The exact mode's drafters, one per file behind one interface (`base.Drafter`: propose drafts for a sequence,
observe what verification accepted), and the registry that builds a sequence's drafters from its settings.

Adding a drafter is adding a file with a `Drafter` subclass and registering its factory in `DRAFTERS`, at the place
in the order where its drafts should be preferred: a round verifies the first proposal that has drafts.

The plan of plan and infill is not a drafter: it drafts every masked slot of a block and commits by ReFusion's own
acceptance rule (slots out of order, parallel completion), not by AR decoding's accepted prefix, so it is a program of
its own (`programs/plan_and_infill.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from refusion.decode.drafters.base import DraftContext, Drafter, Proposal, Verdict, draft_bound, propose
from refusion.decode.drafters.masks import MaskDrafter
from refusion.decode.drafters.prompt_lookup import PromptLookup
from refusion.decode.drafters.table import TableDrafter

DRAFTERS: dict[str, Callable[..., Drafter | None]] = {
    "lookup": PromptLookup.for_sequence, "table": TableDrafter.for_sequence, "masks": MaskDrafter.for_sequence,
}
"""Each drafter's factory: (sequence) -> its drafter, or None where the sequence's settings turn it off. In order of
preference: text copied from the sequence itself first, then the model's draft table, then the masks."""


def drafters_for(seq) -> list[Drafter]:
    """The drafters of a sequence (`decode.sequence.Sequence`), in registry order."""
    return [d for factory in DRAFTERS.values() if (d := factory(seq)) is not None]


__all__ = ["DRAFTERS", "DraftContext", "Drafter", "MaskDrafter", "PromptLookup", "Proposal", "TableDrafter",
           "Verdict", "draft_bound", "drafters_for", "propose"]
