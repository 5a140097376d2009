"""Prefix caching: the KV entries of prompt prefixes kept across requests, so that a prompt that starts as an earlier
one did (a chat client resending the conversation, an application's shared system prompt) prefills only the rest.

Prompts are cut into blocks of `BLOCK_TOKENS` tokens from their first token. A block is found by its parent block
and its own tokens, so it stands for the whole prefix up to its end (vLLM chains block hashes the same way; here the
dictionary compares the tokens themselves, so no hash collision can return another prefix's entries). Chains start
at a root of their own for each model and dtype (`Namespace`). What is stored is a prompt's prefill output: the KV
entries of its whole blocks, after its first forward; and when an answer of AR decoding or the exact mode finishes,
the whole blocks of prompt and answer together (`ANSWER_STRATEGIES`; never plan and infill's, whose entries are
computed against drafts), so that a chat's next turn, which resends the answer, finds it. A lookup leaves at least
the prompt's last token to the prefill, whose logits start the answer.

Blocks are evicted least recently used first, under a byte budget. A lookup or a store touches a chain from its
last block back to its first, so a block is always used more recently than its children: eviction takes leaves,
and no block outlives its parent.

The decoder (`loop.Decoder`) looks a prompt up when it joins the batch, hands the hit to its `Sequence`
(`reuse_prefix`: the entries join the context through the cache's `add_context`) and stores the prompt's new
blocks once its first forward is committed (`context_entries`). Whether reused entries keep every answer as it is
depends on the setup (`inexact_reason`; docs/SERVING.md, "Prefix caching").
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

ANSWER_STRATEGIES = ("autoregressive", "speculative")
"""Strategies whose answers' entries are kept too: each committed token's entry is computed over the context before
it alone, as a prefill row computes it (AR decoding's; the exact mode's accepted drafts, verified in the chain).
Plan and infill's entries are computed beside drafts that were then changed: only its prompts' are kept."""
BLOCK_TOKENS = 16
"""Tokens per block: prefixes are reused in whole blocks (vLLM's default block size)."""

Namespace = tuple
"""(the model, weakly referenced; its dtype; the dtype its cache keeps entries in): a root of chains (`namespace_of`)."""


def namespace_of(model, kv_dtype: torch.dtype | None) -> Namespace:
    """The namespace of `model`'s prefixes: entries computed by another model or in another dtype never match (a
    model that is gone matches nothing: its weak reference is dead)."""
    return weakref.ref(model), str(model_dtype(model)), str(kv_dtype)


def model_dtype(model) -> torch.dtype | None:
    """The model's parameters' dtype (a wrapper module without `.dtype` included)."""
    parameter = next(model.parameters(), None)
    return parameter.dtype if parameter is not None else getattr(model, "dtype", None)


def inexact_reason(model, setup) -> str | None:
    """Why prefilling a prompt's rest over reused entries could change an answer on this setup, or None when it
    cannot: where forwards are row-exact (`ModelSetup.row_exact`), every row of a split prefill is computed bit for
    bit as in one forward; in fp32 and fp64 a split prefill rounds as a batch's other rows make a forward round,
    which changes no token in any test (docs/DECODING.md, Guarantees). Other dtypes and compiled forwards round
    differently by width often enough to flip near-ties."""
    if setup.compiled is not None:
        return "compiled forwards pad each width to a bucket whose kernels round their own way"
    if setup.row_exact or model_dtype(model) in (torch.float32, torch.float64):
        return None
    return (f"{str(model_dtype(model)).removeprefix('torch.')} forwards without row-exact kernels round a split prefill "
            "differently (a near-tie could flip a token)")


def prefix_cache_for(model, setup, megabytes: int) -> tuple[PrefixCache | None, str]:
    """(a prefix cache of `megabytes` MiB for `model`, one line saying so), or (None, why not): 0 MiB, or a setup
    where reused entries could change an answer (`inexact_reason`)."""
    if megabytes == 0:
        return None, "prefix cache off (0 MiB)"
    reason = inexact_reason(model, setup)
    if reason is not None:
        return None, f"prefix cache off: {reason}"
    return PrefixCache(megabytes * 2**20), f"prefix cache {megabytes} MiB"


@dataclass
class Block:
    """The KV entries of one block of a prompt prefix."""

    id: int
    """Unique among the cache's blocks and roots (its children's parent)."""
    key: tuple
    """(parent id, tokens): where the cache finds it."""
    keys: list[torch.Tensor]
    """Per layer [kv_heads, BLOCK_TOKENS, head_dim]."""
    values: list[torch.Tensor]
    """Per layer [kv_heads, BLOCK_TOKENS, head_dim]."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class PrefixHit:
    """The entries of the longest cached prefix of a prompt."""

    length: int
    """Tokens of the prefix (a multiple of the block size; 0: none)."""
    keys: list[torch.Tensor]
    """Per layer [kv_heads, length, head_dim] (empty when length is 0)."""
    values: list[torch.Tensor]
    """Per layer [kv_heads, length, head_dim]."""


class PrefixCache:
    """Blocks of prompt prefixes' KV entries, least recently used evicted first under `budget_bytes` (see the module
    docstring)."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if budget_bytes <= 0 or block_tokens < 1:
            raise ValueError(f"a prefix cache needs a budget > 0 bytes (got {budget_bytes}) and blocks of >= 1 "
                             f"token (got {block_tokens})")
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self._roots: dict[Namespace, int] = {}
        self._next_id = 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _root(self, namespace: Namespace) -> int:
        if namespace not in self._roots:
            self._roots[namespace] = self._new_id()
        return self._roots[namespace]

    def _chain(self, namespace: Namespace, tokens: list[int], limit: int) -> list[Block]:
        """The cached blocks of `tokens` from the first, as far as they go and cover at most `limit` tokens."""
        chain, parent, b = [], self._root(namespace), self.block_tokens
        for start in range(0, limit - b + 1, b):
            block = self.blocks.get((parent, tuple(tokens[start:start + b])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[Block]) -> None:
        """Mark a chain used, its last block first: a parent stays more recently used than its children."""
        for block in reversed(chain):
            self.blocks.move_to_end(block.key)

    def lookup(self, namespace: Namespace, prompt: list[int]) -> PrefixHit:
        """The longest cached prefix of `prompt` that leaves its last token to prefill."""
        chain = self._chain(namespace, prompt, len(prompt) - 1)
        if not chain:
            return PrefixHit(0, [], [])
        self._touch(chain)
        layers = range(len(chain[0].keys))
        return PrefixHit(len(chain) * self.block_tokens,
                         [torch.cat([block.keys[i] for block in chain], 1) for i in layers],
                         [torch.cat([block.values[i] for block in chain], 1) for i in layers])

    def unstored(self, namespace: Namespace, prompt: list[int]) -> tuple[int, int]:
        """[start, stop): the positions of the prompt's whole blocks that are not stored yet (start == stop: none)."""
        stop = len(prompt) // self.block_tokens * self.block_tokens
        return min(len(self._chain(namespace, prompt, stop)) * self.block_tokens, stop), stop

    def store(self, namespace: Namespace, prompt: list[int], start: int, keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> None:
        """Keep the entries of the prompt's whole blocks from position `start` (a block boundary, every block
        before it stored): keys and values per layer [kv_heads, n, head_dim] for positions [start, start + n).
        Blocks stored meanwhile are kept as they are; then blocks are evicted until the budget holds."""
        b = self.block_tokens
        if start % b or keys[0].shape[1] % b:
            raise ValueError(f"prefix blocks are stored whole: start {start}, {keys[0].shape[1]} entries, "
                             f"blocks of {b}")
        chain = self._chain(namespace, prompt, start)
        if len(chain) * b != start:
            return  # an earlier block was evicted meanwhile: these would hang from nothing
        parent = chain[-1].id if chain else self._root(namespace)
        for offset in range(0, keys[0].shape[1], b):
            key = (parent, tuple(prompt[start + offset:start + offset + b]))
            block = self.blocks.get(key)
            if block is None:
                block = Block(self._new_id(), key, [k[:, offset:offset + b].clone() for k in keys],
                              [v[:, offset:offset + b].clone() for v in values])
                self.blocks[key] = block
                self.nbytes += block.nbytes
            chain.append(block)
            parent = block.id
        self._touch(chain)
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used blocks (leaves: see the module docstring) until the budget holds."""
        while self.nbytes > self.budget_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.nbytes -= block.nbytes

    @property
    def tokens(self) -> int:
        """Prompt tokens whose entries are held."""
        return len(self.blocks) * self.block_tokens


def narrowed(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors in `dtype` where that keeps every value (exact attention's fp64 entries hold bf16 values: stored
    in bf16 they take a quarter of the memory), else as they are (so are entries already narrower than `dtype`:
    fp16 ones of an fp32 model, `row_exact.exact_half_attention`'s)."""
    if all(t.dtype.itemsize <= dtype.itemsize for t in tensors):
        return tensors
    narrow = [t.to(dtype) for t in tensors]
    return narrow if all(torch.equal(n.to(t.dtype), t) for n, t in zip(narrow, tensors)) else tensors
