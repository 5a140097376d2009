"""When a padded batch's attention runs row by row over each row's real queries (`compact.Ragged.split`): the rule,
on shapes alone, that the decoding forward (`decode.forward.CachedForward`) follows and the forward costs
(`calibration.ForwardCosts.of_batch`) price. It imports nothing, so the cost record (which imports no torch) reads
the same rule the forward applies.
"""

from __future__ import annotations

SPLIT_WORK = 1024
"""Padding queries times attended columns, per extra attention call, from which sdpa runs sequence by sequence over
each one's real queries instead of once over the padded layout (`splits_attention`). A padded query costs what a real
one does there: a 143-token prefill joining three one-token steps over ~1,500 columns paid four times its own
attention (E5, docs/archive/BENCHMARKS-JOURNAL.md, *Attention over the real rows*), while an extra call costs about
what ~1,000 query columns do."""


def splits_attention(batch: int, rows: int, width: int, columns: int) -> bool:
    """Whether a padded forward of `batch` sequences holding `rows` real tokens, padded to `width` each, over
    `columns` cache columns (its own included), runs sdpa row by row over the real queries alone (`SPLIT_WORK`).
    Decided on shapes alone, so the same forward splits alike in every process. Only sdpa splits
    (`compact.CompactForward`): it computes every padded query, where the C++ layers' exact attention computes the
    real rows alone in one call. Splitting keeps each row's attention exactly what it is but may round a row's fp32 sums
    differently (sdpa's blocks depend on how many queries a call holds), as a different batch width does."""
    return batch > 1 and (batch * width - rows) * columns >= SPLIT_WORK * (batch - 1)
