"""The micro-batch stream: disjoint shares per process, deterministic batches, length bucketing."""

from __future__ import annotations

import pytest
import torch

from refusion.train.batching import BatchRecipe, MicroBatchStream, batches_per_epoch, plan_epoch
from refusion.train.data import TokenizedData


@pytest.mark.parametrize("bucket", [False, True])
def test_processes_get_disjoint_shares_of_each_epoch(bucket):
    lengths = [5 + (i * 7) % 50 for i in range(103)]
    plans = [plan_epoch(lengths, epoch=0, seed=1, batch_size=4, world_size=3, rank=r, bucket_by_length=bucket)
             for r in range(3)]
    assert all(len(p) == 103 // 12 for p in plans)
    seen = [i for plan in plans for batch in plan for i in batch]
    assert len(seen) == len(set(seen)) == 12 * (103 // 12)
    again = plan_epoch(lengths, epoch=0, seed=1, batch_size=4, world_size=3, rank=0, bucket_by_length=bucket)
    assert again == plans[0]
    assert plan_epoch(lengths, epoch=1, seed=1, batch_size=4, world_size=3, rank=0, bucket_by_length=bucket) != again


def test_bucketing_reduces_padding():
    lengths = [int(x) for x in torch.randint(10, 500, (2048,), generator=torch.Generator().manual_seed(0))]

    def padded(bucket):
        plan = plan_epoch(lengths, epoch=0, seed=0, batch_size=8, world_size=1, rank=0, bucket_by_length=bucket)
        return sum(max(lengths[i] for i in b) * len(b) for b in plan)

    assert padded(True) < 0.7 * padded(False)


def test_too_few_samples_is_an_error():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        batches_per_epoch(5, 4, 2)


def test_micro_batches_are_pure_functions_of_their_index():
    data = TokenizedData(prompts=[torch.arange(3)] * 10, responses=[torch.arange(10, 10 + 5 + i) for i in range(10)])
    recipe = BatchRecipe("hybrid", (2, 4), 63, 0, 2)
    stream = MicroBatchStream(data, recipe, seed=0, batch_size=2, world_size=1, rank=0)
    assert stream.per_epoch == 5
    forward = [stream[m] for m in range(12)]
    fresh = MicroBatchStream(data, recipe, seed=0, batch_size=2, world_size=1, rank=0)
    for m in reversed(range(12)):  # any order, any worker: the same batch
        for key, value in fresh[m].items():
            assert torch.equal(value, forward[m][key])
    # epochs wrap: micro-batch 5 starts epoch 1 with a new order over the same samples
    first_epoch = sorted(i for m in range(5) for i in forward[m]["sample_indices"].tolist())
    assert first_epoch == list(range(10))
