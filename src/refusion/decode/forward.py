"""One forward of a model over a `SlotCache`: the call every decoding step makes, in one place.

The batching loop (`loop.Decoder`) runs each step's batched forward through it, and the forward-cost probe
(`costs.measure`) times forwards through it, so what the probe prices is what a decoding step pays: the compact
(or native) layers where they apply, else transformers' forward, compiled or not, over the same cache and masks.
"""

from __future__ import annotations

import inspect
import time

import torch

from refusion.decode.cache import PADDING, SlotCache, attention_mask_dtype, attention_windows, cache_keyword
from refusion.model.attention_split import splits_attention
from refusion.model.compact import Ragged, compact_forward
from refusion.model.compiled import run_compiled, static_capacity
from refusion.model.kernels.row_exact import cache_dtype


def kv_layout(text_config, dtype: torch.dtype) -> tuple[int, int, torch.dtype]:
    """(KV heads, head dim, dtype) of a model's cache entries, what a fixed-shape cache allocates up front."""
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return getattr(text_config, "num_key_value_heads", None) or heads, head_dim, dtype


class CachedForward:
    """A model's forward over a `SlotCache`, as a `ModelSetup` says to run it."""

    def __init__(self, model, setup):
        """`setup`: the model's `ModelSetup` (its compiled forward, its compact forward and whether to use it)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.compiled = setup.compiled  # the model's compiled forward (fixed shapes: `model.compiled`), or None
        # eager forwards of a supported family skip transformers' per-layer Python (the same bits: `model.compact`)
        self.compact = (compact_forward(model, setup.compact_forward) if setup.compact and self.compiled is None
                        else None)
        self.splits_attention = (self.compact is not None and self.device.type == "cpu"
                                 and self.compact.attn_implementation == "sdpa")
        """Whether a padded forward may run attention row by row over the real queries
        (`attention_split.splits_attention` decides which): the compact forward on the CPU with sdpa."""
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_keyword = cache_keyword(model)

    def new_cache(self, capacity: int) -> SlotCache:
        """An empty cache for this forward: fixed shapes (a capacity rounded up) when compiled, fp64 entries under
        exact attention (`row_exact.cache_dtype`)."""
        model, static = self.model, None
        text_config = model.config.get_text_config()
        if self.compiled is not None:
            capacity, static = static_capacity(capacity), kv_layout(text_config, model.dtype)
        return SlotCache(text_config.num_hidden_layers, self.device, capacity, attention_mask_dtype(model),
                         attention_windows(text_config), static=static,
                         kv_dtype=None if static else cache_dtype(model))

    def __call__(self, cache: SlotCache, input_ids: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor,
                 lower_upto: torch.Tensor | None, counts: list[int], needs: list[int],
                 bucket: int | None = None) -> tuple[list[torch.Tensor], float]:
        """(each row's logits [needs[b], V] of its last needs[b] tokens, seconds in the model's forward): one
        forward of the [B, W] inputs, right-aligned (`counts`: each row's real tokens; `bucket`: the compiled width
        they were padded to). On the CPU, where a product's cost grows with its rows, the compact forward computes a
        padded batch's real rows alone (`compact.Ragged`), and sdpa over each row's real queries alone where the
        padding's would cost more than the extra calls (`attention_split.splits_attention`); a GPU computes the
        padding in the same kernels."""
        mask = cache.begin_forward(groups, positions, lower_upto, counts)
        keep = max(needs)
        kwargs = {"logits_to_keep": bucket or keep} if self._logits_to_keep else {}  # compiled: fixed
        batch, width = input_ids.shape
        start = time.perf_counter()
        if self.compact is not None and self.device.type == "cpu" and sum(counts) < batch * width:
            split = self.splits_attention and splits_attention(batch, sum(counts), width, cache.used + width)
            ragged = Ragged.of(counts, needs, width, self.device, split)
            logits = self.compact(input_ids, positions, mask, cache, keep, ragged)[0].split(needs)
        elif self.compact is not None:
            logits = self.compact(input_ids, positions, mask, cache, keep)
        else:
            inputs = dict(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                          **{self._cache_keyword: cache.hf}, **kwargs)
            out = run_compiled(self.compiled, **inputs) if bucket else self.model(**inputs)
            logits = out.logits[:, -keep:]  # [B, keep, V]
            if bucket:
                logits = logits.clone()  # a CUDA graph's output buffer is overwritten by its next replay
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        cache.end_forward()
        if isinstance(logits, torch.Tensor):  # [B, keep, V]
            logits = [logits[b, keep - need:] for b, need in enumerate(needs)]
        return list(logits), seconds


def padded_inputs(requests: list, width: int, branched: bool, device: torch.device):
    """(input_ids, positions, groups, lower_upto or None), each [B, width]: the requests (`sequence.Forward`s)
    right-aligned (left padding: group PADDING, lower_upto -1), the layout `CachedForward` takes."""
    batch = len(requests)
    input_ids = torch.zeros(batch, width, dtype=torch.long, device=device)
    positions = torch.zeros(batch, width, dtype=torch.long, device=device)
    groups = torch.full((batch, width), PADDING, dtype=torch.long, device=device)
    lower_upto = torch.full((batch, width), -1, dtype=torch.long, device=device) if branched else None
    for b, r in enumerate(requests):
        n = r.tokens.numel()
        input_ids[b, width - n:], positions[b, width - n:], groups[b, width - n:] = r.tokens, r.positions, r.groups
        if r.lower_upto is not None:
            lower_upto[b, width - n:] = r.lower_upto
    return input_ids, positions, groups, lower_upto
