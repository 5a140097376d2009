"""The stream of micro-batches: which samples go where, and the generator that noises each batch.

Every micro-batch is a pure function of (seed, epoch, rank, batch index), so
- data-loader workers can build batches in any order and still produce the same ones,
- a resumed run rebuilds exactly the batches it would have seen (no data-loader state to save),
- each process gets a disjoint share of every global batch.

Micro-batches form one stream across epochs: micro-batch m of a process is batch m % B of epoch m // B,
where B is the number of micro-batches per epoch and process (the last incomplete global batch is dropped).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from refusion.train.data import TokenizedData
from refusion.train.noising import build_ar_sample, build_chain_sample, build_hybrid_sample, collate

BUCKET_SPAN = 64  # global batches per length-sorted bucket window


def derived_generator(*keys: int) -> torch.Generator:
    """A torch.Generator seeded from integer keys (stable across processes and Python runs)."""
    digest = hashlib.sha256("/".join(str(k) for k in keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int) -> int:
    """Micro-batches each process gets per epoch (whole global batches only)."""
    count = num_samples // (batch_size * world_size)
    if count == 0:
        raise ValueError(f"{num_samples} training samples cannot fill one global batch of "
                         f"batch_size={batch_size} x {world_size} process(es)")
    return count


def plan_epoch(lengths: list[int], *, epoch: int, seed: int, batch_size: int, world_size: int, rank: int,
               bucket_by_length: bool = False) -> list[list[int]]:
    """Sample indices of each micro-batch of `rank` in `epoch`: shuffled global batches, rank r takes its slice.

    With `bucket_by_length`, windows of BUCKET_SPAN global batches are sorted by length before being cut
    into global batches, and the global batches are shuffled again.
    """
    generator = derived_generator(seed, epoch, "order")
    order = torch.randperm(len(lengths), generator=generator)
    global_size = batch_size * world_size
    n_global = batches_per_epoch(len(lengths), batch_size, world_size)
    order = order[: n_global * global_size]
    if bucket_by_length:
        order = _bucket(order, torch.tensor(lengths), global_size * BUCKET_SPAN)
    global_batches = order.view(n_global, global_size)                        # [n_global, batch * world]
    if bucket_by_length:
        global_batches = global_batches[torch.randperm(n_global, generator=generator)]
    mine = global_batches[:, rank * batch_size:(rank + 1) * batch_size]       # [n_global, batch]
    return mine.tolist()


def _bucket(order: torch.Tensor, lengths: torch.Tensor, window: int) -> torch.Tensor:
    chunks = [chunk[torch.argsort(lengths[chunk], stable=True)] for chunk in order.split(window)]
    return torch.cat(chunks)


@dataclass(frozen=True)
class BatchRecipe:
    """How to turn samples into a training micro-batch."""

    objective: str
    """"hybrid" or "ar"."""
    slot_sizes: tuple[int, ...]
    """Slot sizes k are drawn from."""
    mask_token_id: int
    """Id of <|mask|>."""
    pad_token_id: int
    """Id written into padding (never attended to by real tokens, never a label)."""
    eos_token_id: int
    """Response EOS (the label of EOS slots)."""
    eos_slots: int = 0
    """Always-masked EOS slots appended to each response."""
    chain_fraction: float = 0.0
    """Share of samples laid out as draft chains (noising.build_chain_sample) instead of slots."""
    chain_masks: int = 9
    """Masks per draft chain."""
    chain_stride: int = 4
    """Tokens between consecutive chain starts."""


class MicroBatchStream(Dataset):
    """Map-style dataset over the micro-batch stream of one process: item m is micro-batch m (see module doc)."""

    def __init__(self, data: TokenizedData, recipe: BatchRecipe, *, seed: int, batch_size: int, world_size: int,
                 rank: int, bucket_by_length: bool = False):
        self.data, self.recipe, self.seed = data, recipe, seed
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.bucket_by_length = bucket_by_length
        self.per_epoch = batches_per_epoch(len(data), batch_size, world_size)
        self._plans: dict[int, list[list[int]]] = {}

    def sample_indices(self, m: int) -> list[int]:
        epoch, index = divmod(m, self.per_epoch)
        if epoch not in self._plans:
            self._plans = {epoch: plan_epoch(self.data.lengths, epoch=epoch, seed=self.seed,
                                             batch_size=self.batch_size, world_size=self.world_size,
                                             rank=self.rank, bucket_by_length=self.bucket_by_length)}
        return self._plans[epoch][index]

    def __len__(self) -> int:  # unbounded stream; samplers give the range
        return 2**62

    def __getitem__(self, m: int) -> dict[str, torch.Tensor]:
        indices = self.sample_indices(m)
        generator = derived_generator(self.seed, m, self.rank, "noise")
        r = self.recipe
        samples = []
        for i in indices:
            prompt, response = self.data.prompts[i], self.data.responses[i]
            if r.objective == "ar":
                samples.append(build_ar_sample(prompt, response))
            elif r.chain_fraction and float(torch.rand((), generator=generator)) < r.chain_fraction:
                samples.append(build_chain_sample(prompt, response, chain_masks=r.chain_masks,
                                                  stride=r.chain_stride, mask_token_id=r.mask_token_id,
                                                  generator=generator))
            else:
                samples.append(build_hybrid_sample(prompt, response, slot_sizes=r.slot_sizes,
                                                   mask_token_id=r.mask_token_id, generator=generator,
                                                   eos_slots=r.eos_slots, eos_token_id=r.eos_token_id))
        batch = collate(samples, pad_token_id=r.pad_token_id)
        batch["sample_indices"] = torch.tensor(indices)
        return batch
