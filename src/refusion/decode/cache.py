"""The KV cache of a batch of ReFusion sequences: the only code that manages KV tensors (the native decoder layers
write a forward's entries where `native_storage` tells them, as `write` would).

ReFusion needs two things from a cache that an ordinary left-to-right cache does not give:

* entries are *not* in text order (committed slots are appended in commit order, each with its true
  position id already applied by RoPE), so a sequence's cache is a *bag* of entries: attention over the
  cached context is order-free, and only the new tokens of one forward attend causally to each other;
* during parallel completion several rows (one per selected slot) share the context, and each row
  keeps KV computed against the context and its own prefix only.

Both are served by one preallocated buffer per layer, ``[batch, kv_heads, capacity, head_dim]`` (the first rows of a
storage that keeps the rows finished sequences left, for the next to join: `remove_sequences`), and two
metadata tensors per column: ``owner`` (EMPTY, CONTEXT, or the group id of a pending entry) and ``pos``
(the entry's position id). A query of group g sees every CONTEXT entry, the pending entries of group g
written before it, and itself (a padding query, which only fills a batch's rows to the widest, sees its row's
padding alone). Rows of parallel completion are groups; plan and verification forwards
use group 0. A query may also read the pending entries of every *lower* group up to a position id of its
own (``lower_upto``): this is how a forward carries branches that build on other groups' tokens (the fused
plan's masks read every completed row; speculative pre-drafts read a prefix of the draft chain). Pending entries are then committed (become CONTEXT), retained, or dropped by position id, so
the decoding programs never see column indices and the buffer can be compacted at any time.

Sliding-window attention (Mistral, Gemma, Qwen2 with `max_window_layers`): on a layer with window w, a query
at position q also needs q - p < w to read an entry at position p (transformers' rule, on position ids, since
the bag is not in text order). One window for every layer gives one mask; layers of several kinds give a dict
of masks keyed by layer type, which is how transformers models with `config.layer_types` take them.

Fixed shapes (`static=True`, what a compiled forward needs: `model.compiled`): the KV buffers are allocated before
the first forward, a forward writes its new entries at the columns the cache reserved for it (a small index tensor,
not a Python slice), every layer attends over the whole buffer, and the mask always covers it (unused columns are
EMPTY, so invisible). The shapes of a forward then depend on its batch size, its width and the capacity alone, and
nothing in it reads a Python number that changes from step to step.

Prompt prefixes (`decode.prefix_cache`): `context_entries` copies a sequence's context entries out (its prompt's, once
prefilled) and `add_context` writes entries computed earlier into a new sequence's row as CONTEXT, in position order
in its first columns, so they sit before the entries of its first forward as the same prompt's own entries would.

Invariant, checked on every commit: a sequence's CONTEXT entries are exactly its committed tokens. Checking reads
two counts back to the host; on a GPU, where each read waits for the device, it is off unless `REFUSION_CHECK_CACHE=1`
(the tests' CUDA run sets it). Entries change state by masked writes, never by boolean indexing (which would read
the mask back to the host too).

Reads back to the host are few: the cache keeps on the host how many pending entries each row holds (what its
forwards wrote, less what was committed) and whether anything may have been dropped since it last looked. Only then
(an entry dropped, a forward padded, a row removed) or when the buffer is full does it read the device's metadata
back, once, to reuse the emptied tail and decide on compaction. A sequence decoded AR-style (every entry committed,
none dropped) never makes it look, and its eager forwards take the mask-free path without reading anything back.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from refusion.model.kernels.row_exact import ADDITIVE_MASK_ATTENTION

CHECK_ENV = "REFUSION_CHECK_CACHE"
"""Set to 1 to check the cache's invariant on every commit (the test suite sets it for every test and the processes
they start)."""


def checks_by_default() -> bool:
    """Whether a cache checks its invariant on every commit: where REFUSION_CHECK_CACHE=1. Off otherwise: the check
    reads the row back twice a commit (on E5, ~1 ms of every 8-sequence step of the embedded model, 2-3 % of it),
    and the tests decode every strategy with it on."""
    return os.environ.get(CHECK_ENV) == "1"


EMPTY = -2
CONTEXT = -1
PADDING = -3
WINDOWED_LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer kinds whose masks we can build


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` (transformers >= 5.24) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def attention_mask_dtype(model) -> torch.dtype | None:
    """The dtype of the masks a model's attention takes: None for boolean (sdpa), the model's dtype for additive
    ones. Raises ValueError for implementations that cannot take ReFusion's masks (flash attention, ...)."""
    attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    if attn == "sdpa":
        return None
    if attn in ADDITIVE_MASK_ATTENTION:
        return model.dtype
    raise ValueError(f"attention implementation {attn!r} cannot take the masks ReFusion needs: "
                     f"load the model with attn_implementation='sdpa' (or one of {', '.join(ADDITIVE_MASK_ATTENTION)})")


def attention_windows(config) -> dict[str, int | None]:
    """The window of each kind of attention layer of a (text) config: {layer type: window, None for full}.

    Raises ValueError for layer kinds whose masks the cache cannot build (chunked, linear, ...)."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # one kind of layer: windowed everywhere when the config has a window (Mistral)
        return {"sliding_attention": window} if window else {"full_attention": None}
    unknown = sorted(set(layer_types) - set(WINDOWED_LAYER_TYPES))
    if unknown:
        raise ValueError(f"attention layers of type {', '.join(unknown)} are not supported: refusion builds masks "
                         "for full_attention and sliding_attention layers only")
    if "sliding_attention" in layer_types and not window:
        raise ValueError("the model has sliding_attention layers but its config gives no sliding_window")
    return {kind: window if kind == "sliding_attention" else None for kind in sorted(set(layer_types))}


@functools.cache
def _buffer_layer_class():
    """The transformers cache layer that writes into the SlotCache buffer of its layer (defined on first use: a
    model refusion defines itself takes the SlotCache directly, and decoding it never imports transformers)."""
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):
        def __init__(self, owner: SlotCache, index: int):
            super().__init__()
            self.owner, self.index = owner, index

        def update(self, key_states, value_states, *args, **kwargs):
            return self.owner.write(self.index, key_states, value_states)

        def get_seq_length(self) -> int:
            return self.owner.used

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return (self.owner.capacity if self.owner.static else self.owner.used + query_length), 0

    return BufferLayer


class SlotCache:
    """Batched bag-of-entries KV cache with per-group visibility (see the module docstring)."""

    def __init__(self, num_layers: int, device: torch.device, capacity: int = 256, mask_dtype: torch.dtype | None = None,
                 windows: dict[str, int | None] | None = None, static: tuple[int, int, torch.dtype] | None = None,
                 check_invariants: bool | None = None, kv_dtype: torch.dtype | None = None):
        """static: (kv heads, head dim, dtype) for fixed shapes (see the module docstring); None: slices that grow.
        check_invariants: check the invariant on every commit; None: where REFUSION_CHECK_CACHE=1 (the test suite
        sets it).
        kv_dtype: the dtype entries are kept in (each written value converted once); None: the one the layers write
        (`row_exact.cache_dtype` says when another pays)."""
        self.num_layers = num_layers
        self.static = static
        self.kv_dtype = kv_dtype
        self.check_invariants = checks_by_default() if check_invariants is None else check_invariants
        # {layer type: sliding window or None}: one entry -> one mask for every layer, several -> a dict of masks
        self.windows = windows or {"full_attention": None}
        self.device = torch.device(device)
        self.compacts_by_row = self.device.type == "cpu"
        """How `compact` moves entries: row by row (`_move_live_by_row`, the CPU) or one gather per buffer."""
        self.capacity = capacity
        self.mask_dtype = mask_dtype  # None: boolean mask (sdpa); a float dtype: additive mask (eager)
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [B, H, C, D]: the first B rows of _key_rows
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # the storage behind them, [R, H, C, D] with R >= B: the rows finished sequences left wait for the next to join
        self._key_rows: list[torch.Tensor | None] = [None] * num_layers
        self._value_rows: list[torch.Tensor | None] = [None] * num_layers
        self.owner = torch.empty(0, capacity, dtype=torch.long, device=self.device)  # [B, C]
        self.pos = torch.empty(0, capacity, dtype=torch.long, device=self.device)  # [B, C]
        self.used = 0  # columns written so far (all rows)
        self.row_of: dict[int, int] = {}  # sequence id -> batch row
        self.committed: dict[int, int] = {}  # sequence id -> number of committed tokens
        self._pending_width = 0  # columns reserved by the forward in flight
        self._columns: torch.Tensor | None = None  # static: those columns, as the index the layers write at
        self._pending_count: dict[int, int | None] = {}  # sequence id -> its pending entries (None: unknown)
        self._dirty = False  # entries may have been dropped (or padding freed) since the metadata was last read
        self._holes = False  # some row may have an EMPTY column before `used` (as of the last read)
        self._padded = False  # the forward in flight has padding columns
        self._hf = None

    @property
    def hf(self):
        """This cache as a transformers `Cache` (what a transformers model's forward takes), built on first use."""
        if self._hf is None:
            from transformers.cache_utils import Cache

            layer = _buffer_layer_class()
            self._hf = Cache(layers=[layer(self, i) for i in range(self.num_layers)])
        return self._hf

    # ----------------------------------------------------------------------------- rows
    @property
    def batch_size(self) -> int:
        return self.owner.shape[0]

    def add_sequence(self, seq_id: int) -> None:
        """Give a new sequence an empty row."""
        assert seq_id not in self.row_of, f"sequence {seq_id} already has a row"
        self.row_of[seq_id] = self.batch_size
        self.committed[seq_id] = 0
        self._pending_count[seq_id] = 0
        self._holes = self._holes or self.used > 0  # the new row is EMPTY up to `used`
        new_meta = torch.full((1, self.capacity), EMPTY, dtype=torch.long, device=self.device)
        self.owner = torch.cat([self.owner, new_meta])
        self.pos = torch.cat([self.pos, torch.zeros_like(new_meta)])
        # the KV buffers get the new row at their next use (_kv_rows): a freed row, else one copy for all that join

    def _kv_rows(self) -> None:
        """Give the KV buffers a row for every sequence added since they were last touched: a row a finished sequence
        left (its old entries stay behind EMPTY columns, which no query sees), else a new zero row. In a continuous
        batch, where one sequence joins as another leaves, a join copies nothing."""
        changed = False
        for i, k in enumerate(self.keys):
            if k is None or k.shape[0] == self.batch_size:
                continue
            missing = self.batch_size - self._key_rows[i].shape[0]
            if missing > 0:
                k, v = self._key_rows[i], self._value_rows[i]
                self._key_rows[i] = torch.cat([k, k.new_zeros(missing, *k.shape[1:])])
                self._value_rows[i] = torch.cat([v, v.new_zeros(missing, *v.shape[1:])])
            self.keys[i], self.values[i] = self._key_rows[i][:self.batch_size], self._value_rows[i][:self.batch_size]
            changed = True
        if changed:  # the buffers are new tensors (new views of the same storage, as remove_sequences makes)
            self._mark_static()

    def _set_storage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New KV storage for a layer, one row per sequence (no row to spare)."""
        self.keys[layer] = self._key_rows[layer] = keys
        self.values[layer] = self._value_rows[layer] = values

    def _writing_between_steps(self):
        """The mode for writing the buffers in place outside a forward (a row freed when a client goes away, a cached
        prompt prefix written as a request joins): inference mode where a step (which runs in it) made them."""
        made = next((k for k in self.keys if k is not None), None)
        return torch.inference_mode(made is not None and made.is_inference())

    def remove_sequences(self, seq_ids: list[int]) -> None:
        """Free the rows of finished sequences (they cost no more compute): the last row moves into each freed one, so
        a leave copies one row's entries per layer, and the freed rows stay allocated for the next sequences."""
        if not seq_ids:
            return
        with self._writing_between_steps():
            self._remove_rows(seq_ids)

    def _remove_rows(self, seq_ids: list[int]) -> None:
        self._kv_rows()
        gone = sorted((self.row_of.pop(s) for s in seq_ids), reverse=True)  # rows after each are live when it is
        for s in seq_ids:
            self.committed.pop(s)
            self._pending_count.pop(s)
        self._dirty = True  # the columns only they used are free
        seq_at = {row: s for s, row in self.row_of.items()}
        last = self.batch_size - 1
        for row in gone:
            if row != last:
                self._move_row(last, row)
                seq_at[row] = seq_at.pop(last)
                self.row_of[seq_at[row]] = row
            last -= 1
        rows = len(self.row_of)
        self.owner, self.pos = self.owner[:rows], self.pos[:rows]
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i], self.values[i] = self._key_rows[i][:rows], self._value_rows[i][:rows]
        self._mark_static()
        if not self.row_of:
            self.used, self._dirty, self._holes = 0, False, False

    def _move_row(self, source: int, target: int) -> None:
        """Copy row `source`'s entries (metadata and every layer's keys and values) over row `target`."""
        self.owner[target] = self.owner[source]
        self.pos[target] = self.pos[source]
        for k, v in zip(self.keys, self.values):
            if k is not None:
                k[target, :, :self.used] = k[source, :, :self.used]
                v[target, :, :self.used] = v[source, :, :self.used]

    # ----------------------------------------------------------------------------- forward
    def begin_forward(self, groups: torch.Tensor, positions: torch.Tensor, lower_upto: torch.Tensor | None = None,
                      counts: list[int] | None = None) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Reserve columns for a forward of new tokens and return its 4D attention mask.

        groups, positions: [B, T] (group PADDING for padding tokens); lower_upto: [B, T] or None, the
        position up to which a query also reads the pending entries of lower groups (-1: none); counts: the
        tokens of each row that are not padding, when the caller knows them (the host then knows each row's
        pending entries without reading them back); None: unknown. Returns [B, 1, T, used + T], None when every
        query may see every key, or (layers of several kinds) a dict {layer type: mask}.
        """
        width = groups.shape[1]
        self._kv_rows()
        self._make_room(width)
        context_only = not self._holes and all(n == 0 for n in self._pending_count.values())
        cols = slice(self.used, self.used + width)
        self.owner[:, cols] = groups
        self.pos[:, cols] = positions
        self._pending_width = width
        self._padded = counts is None or any(n < width for n in counts)
        for seq_id, row in self.row_of.items():
            pending = self._pending_count[seq_id]
            self._pending_count[seq_id] = None if counts is None or pending is None else pending + counts[row]
        if self.static:
            self._static_buffers()
            self._columns = torch.arange(self.used, self.used + width, device=self.device)
        return self._attention_mask(groups, lower_upto, context_only)

    def end_forward(self) -> None:
        """Account for the columns just written; padding columns become free."""
        if self._padded:
            cols = slice(self.used, self.used + self._pending_width)
            self.owner[:, cols].masked_fill_(self.owner[:, cols] == PADDING, EMPTY)
            self._dirty = True
        self.used += self._pending_width
        self._pending_width = 0

    def _attention_mask(self, groups: torch.Tensor, lower_upto: torch.Tensor | None,
                        context_only: bool) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """context_only: every column before the forward's is a CONTEXT entry (no hole, nothing pending)."""
        width = groups.shape[1]
        total = self.capacity if self.static else self.used + width  # static: the mask covers the whole buffer
        windowed = any(w is not None for w in self.windows.values())
        if width == 1 and not windowed and not self.static and context_only:
            return None  # one new token per row over a hole-free context: plain attention (the AR fast path)
        owner = self.owner[:, None, :total]  # [B, 1, L]
        key_col = torch.arange(total, device=self.device)  # [L]
        query_col = self._columns if self.static else key_col[self.used:]  # [T]
        earlier = key_col <= query_col[:, None]  # [T, L]
        query_group = groups[:, :, None]  # [B, T, 1]
        # a padding query sees its row's padding alone (never empty; what it computes is dropped), not the context:
        # exact attention then skips the context's columns for it (a padding row cost as much as a real one)
        visible = ((owner == CONTEXT) & (query_group != PADDING)) | ((owner == query_group) & earlier)  # [B, T, L]
        if lower_upto is not None:
            lower = (owner >= 0) & (owner < query_group) & (self.pos[:, None, :total] <= lower_upto[:, :, None])
            visible |= lower & earlier
        if not windowed:
            return self._as_mask(visible)
        distance = self.pos[:, self.used:self.used + width, None] - self.pos[:, None, :total]  # [B, T, L] query - key
        masks = {kind: self._as_mask(visible if window is None else visible & (distance < window))
                 for kind, window in self.windows.items()}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _as_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[B, T, L] visibility -> the [B, 1, T, L] mask the attention implementation takes."""
        visible = visible[:, None]  # [B, 1, T, L]
        if self.mask_dtype is None:
            return visible
        additive = torch.zeros(visible.shape, dtype=self.mask_dtype, device=self.device)
        return additive.masked_fill_(~visible, torch.finfo(self.mask_dtype).min)

    def _static_buffers(self) -> None:
        """Static: allocate every layer's KV buffer before the first forward (none is allocated inside one)."""
        if self.keys[0] is not None:
            return
        heads, head_dim, dtype = self.static
        shape = (self.batch_size, heads, self.capacity, head_dim)
        for layer in range(self.num_layers):
            self._set_storage(layer, torch.zeros(shape, dtype=dtype, device=self.device),
                              torch.zeros(shape, dtype=dtype, device=self.device))
        self._mark_static()

    def _mark_static(self) -> None:
        """Tell the compiler the KV buffers keep their addresses (CUDA graphs then write into them in place)."""
        if self.static and self.device.type == "cuda" and self.keys[0] is not None:
            for buf in self.keys + self.values:
                torch._dynamo.mark_static_address(buf)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a forward's new KV entries of `layer` at the columns `begin_forward` reserved; returns the layer's
        keys and values to attend over."""
        if self.static:  # the reserved columns, by index; the whole buffer is attended (the mask hides the rest)
            self.keys[layer].index_copy_(2, self._columns, key)
            self.values[layer].index_copy_(2, self._columns, value)
            return self.keys[layer], self.values[layer]
        if self.keys[layer] is None:
            self._allocate(layer, key.shape[1], key.shape[3], value.shape[3], key.dtype)
        end = self.used + key.shape[2]
        self.keys[layer][:, :, self.used:end] = key
        self.values[layer][:, :, self.used:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def native_storage(self, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """(keys, values, start) for a forward that writes its KV entries itself, as `write` would (the native
        decoder layers, `model.kernels.native`): layer i's entries for the forward's T new tokens go to
        keys[i][:, :, start:start + T] (values alike) and the layer attends over [:, :, :start + T]. Storage not
        allocated yet is allocated as `write` allocates it (layers writing `dtype` entries). None for a static
        cache (its reserved columns are an index, not a slice)."""
        if self.static:
            return None
        for layer in range(self.num_layers):
            if self.keys[layer] is None:
                self._allocate(layer, kv_heads, head_dim, head_dim, dtype)
        return self.keys, self.values, self.used

    def _allocate(self, layer: int, kv_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype) -> None:
        """Zeroed storage for a layer's keys and values, in `kv_dtype` (else the dtype the layer writes)."""
        shape = (self.batch_size, kv_heads, self.capacity)
        kept = self.kv_dtype or dtype
        self._set_storage(layer, torch.zeros(*shape, key_dim, dtype=kept, device=self.device),
                          torch.zeros(*shape, value_dim, dtype=kept, device=self.device))

    # ----------------------------------------------------------------------------- space
    def _make_room(self, width: int) -> None:
        """Room for `width` more columns: the emptied tail reused, the buffer compacted when holes waste too much of
        it (or when it is full and compacting frees an eighth of it), grown when still full. Reads the metadata back
        only when something may have been dropped since the last read or the buffer is full: otherwise the tail is
        filled and the waste has not changed."""
        if not (self._dirty or self.used + width > self.capacity):
            return
        live = self._read_metadata()
        waste = self.used - live
        full = self.used + width > self.capacity
        # full, a compaction that frees less than an eighth of the buffer only delays growing (near capacity, a
        # chat's long contexts were compacted every few steps, each a copy of the whole buffer)
        if waste > max(64, live // 2) or (full and waste >= max(width, self.capacity // 8)):
            self.compact()
        if self.used + width > self.capacity:
            self._grow(max(self.used + width, int(self.capacity * 1.5)))

    def _read_metadata(self) -> int:
        """One read back to the host: the columns after the last entry of every row are given back (the drafts and
        masks a forward just dropped, instead of holes until the next compaction: a sequence decoded alone keeps
        its context hole-free and in position order, in the columns AR decoding would use), each row's pending
        entries are counted, and whether any row has holes. Returns the live entries of the fullest row."""
        self._dirty = False
        if not self.used:
            self._holes = False
            return 0
        owner = self.owner[:, :self.used]
        live = owner != EMPTY
        last = (live.any(0) * torch.arange(1, self.used + 1, device=self.device)).max()  # columns up to the last entry
        numbers = torch.cat([last[None], live.sum(1), (owner >= 0).sum(1)]).tolist()
        batch = self.batch_size
        self.used, live_counts, pending = numbers[0], numbers[1:1 + batch], numbers[1 + batch:]
        self._holes = any(n < self.used for n in live_counts)
        for seq_id, row in self.row_of.items():
            self._pending_count[seq_id] = pending[row]
        return max(live_counts)

    def compact(self) -> None:
        """Move every row's live entries to the front of the buffer (their order is irrelevant)."""
        if self.used == 0:
            return
        live = self.owner[:, :self.used] != EMPTY  # [B, U]
        order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)  # live first
        first_hole = (~live).to(torch.int8).argmax(1)  # 0 for a row without one: its live count is then U
        numbers = torch.cat([live.sum(1), first_hole]).tolist()
        live_counts, first_holes = numbers[:self.batch_size], numbers[self.batch_size:]
        new_used = max(live_counts)
        self._holes = any(n < new_used for n in live_counts)
        index = order[:, :new_used]  # [B, U']
        self.owner[:, :new_used] = torch.gather(self.owner[:, :self.used], 1, index)
        self.pos[:, :new_used] = torch.gather(self.pos[:, :self.used], 1, index)
        self.owner[:, new_used:] = EMPTY
        if self.compacts_by_row:
            self._move_live_by_row(index, live_counts, first_holes)
        else:
            self._move_live_by_gather(index, new_used)
        self.used = new_used

    def _move_live_by_row(self, index: torch.Tensor, live_counts: list[int], first_holes: list[int]) -> None:
        """`compact`'s move on the CPU: each row's live entries from its first hole on, one index_select per row and
        buffer; a row without a live entry after a hole stays where it is. (A gather over every row's columns reads
        an int64 index 4x the size of fp16 entries: on E5 it took ~55 ms for 8 rows of ~600 columns of the
        embedded model, the row-by-row move a quarter of that.)"""
        for row, (count, hole) in enumerate(zip(live_counts, first_holes)):
            if count == self.used or count <= hole:
                continue
            moved = index[row, hole:count]
            for k, v in zip(self.keys, self.values):
                if k is not None:
                    k[row, :, hole:count] = k[row].index_select(1, moved)
                    v[row, :, hole:count] = v[row].index_select(1, moved)

    def _move_live_by_gather(self, index: torch.Tensor, new_used: int) -> None:
        """`compact`'s move on an accelerator: one gather per buffer over every row (a launch per row and buffer
        would cost more than the bytes)."""
        for k, v in zip(self.keys, self.values):
            if k is None:
                continue
            for buf in (k, v):
                gather_index = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])
                buf[:, :, :new_used] = torch.gather(buf[:, :, :self.used], 2, gather_index)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.owner = torch.cat([self.owner, self.owner.new_full((self.batch_size, extra), EMPTY)], 1)
        self.pos = torch.cat([self.pos, self.pos.new_zeros(self.batch_size, extra)], 1)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self._set_storage(i, torch.cat([k, k.new_zeros(k.shape[0], k.shape[1], extra, k.shape[3])], 2),
                                  torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], extra, v.shape[3])], 2))
        self.capacity = capacity
        self._mark_static()

    # ----------------------------------------------------------------------------- prompt prefixes
    def add_context(self, seq_id: int, positions: torch.Tensor, keys: list[torch.Tensor],
                    values: list[torch.Tensor]) -> None:
        """Entries computed earlier join a sequence's context (a prompt prefix the prefix cache held): keys and
        values per layer [kv_heads, n, head_dim] of the tokens at `positions` [n], in position order, before the
        columns the sequence's next forward writes. A new sequence's row is empty: they go to its first columns,
        beside the other rows' entries (after every column in use, a batch of long cached prompts would stack
        them end to end, and every row would attend over all of them until the next compaction); a row that holds
        entries gets them after every column in use. No forward may be in flight."""
        if self.static:
            raise ValueError("a fixed-shape (compiled) cache takes no entries computed elsewhere")
        assert self._pending_width == 0, "add_context during a forward"
        with self._writing_between_steps():
            self._add_context(seq_id, positions, keys, values)

    def _add_context(self, seq_id: int, positions: torch.Tensor, keys: list[torch.Tensor],
                     values: list[torch.Tensor]) -> None:
        n = positions.numel()
        self._kv_rows()
        fresh = self.committed[seq_id] == 0 and self._pending_count[seq_id] == 0
        self._make_room(max(n - self.used, 0) if fresh else n)
        start = 0 if fresh else self.used
        row, cols = self.row_of[seq_id], slice(start, start + n)
        self.owner[:, self.used: start + n] = EMPTY  # the columns it adds to the layout
        self.owner[row, cols] = CONTEXT
        self.pos[row, cols] = positions
        for layer, (key, value) in enumerate(zip(keys, values)):
            if self.keys[layer] is None:
                self._allocate(layer, key.shape[0], key.shape[2], value.shape[2], key.dtype)
            self.keys[layer][row, :, cols] = key  # converted to the cache's dtype, as `write` does
            self.values[layer][row, :, cols] = value
        self._holes = self._holes or self.batch_size > 1 or start + n < self.used  # EMPTY beside them
        self.used = max(self.used, start + n)
        self.committed[seq_id] += n
        if self.check_invariants:
            self.check(seq_id)

    def context_entries(self, seq_id: int, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the keys and values of a sequence's context entries at positions [start, stop), in position
        order: per layer [kv_heads, stop - start, head_dim] (what `add_context` takes). Reads the columns back."""
        row = self.row_of[seq_id]
        pos = self.pos[row, :self.used]
        chosen = (self.owner[row, :self.used] == CONTEXT) & (pos >= start) & (pos < stop)
        columns = chosen.nonzero().squeeze(1)
        columns = columns[torch.argsort(pos[columns])]
        if columns.numel() != stop - start:
            raise RuntimeError(f"KV cache: {columns.numel()} context entries at positions [{start}, {stop})")
        keys = [k[row].index_select(1, columns) for k in self.keys]
        values = [v[row].index_select(1, columns) for v in self.values]
        return keys, values

    # ----------------------------------------------------------------------------- pending entries
    def _pending(self, seq_id: int) -> tuple[int, torch.Tensor]:
        row = self.row_of[seq_id]
        return row, self.owner[row, :self.used] >= 0

    def commit(self, seq_id: int, positions: torch.Tensor, group: int | torch.Tensor | None = None) -> None:
        """Pending entries at `positions` (of `group`, when several groups hold a position; a tensor: the group of
        each position) join the context; every other pending entry is dropped."""
        row, pending = self._pending(seq_id)
        everything = self._pending_count[seq_id] == positions.numel()  # nothing is dropped (host count)
        if self.check_invariants or not everything:
            pos, owner = self.pos[row, :self.used], self.owner[row, :self.used]
            if isinstance(group, torch.Tensor):  # an entry is chosen when its (position, group) is one of the pairs
                chosen = pending & ((pos == positions[:, None]) & (owner == group[:, None])).any(0)
            else:
                chosen = pending & torch.isin(pos, positions)
                if group is not None:
                    chosen &= owner == group
        else:
            chosen = pending  # every pending entry is one of `positions`
        if self.check_invariants:
            found, held = torch.stack([chosen.sum(), pending.sum()]).tolist()
            if found != positions.numel():
                raise RuntimeError(f"KV cache invariant broken: committing {positions.numel()} tokens, found {found}")
            if self._pending_count[seq_id] not in (None, held):
                raise RuntimeError(f"KV cache invariant broken: {held} pending entries, "
                                   f"{self._pending_count[seq_id]} counted")
        owner = self.owner[row, :self.used]
        if not everything:
            owner.masked_fill_(pending, EMPTY)
            self._dirty = True
        owner.masked_fill_(chosen, CONTEXT)
        self._pending_count[seq_id] = 0
        self.committed[seq_id] += positions.numel()
        if self.check_invariants:
            self.check(seq_id)

    def retain(self, seq_id: int, positions: torch.Tensor | None = None) -> None:
        """Keep the pending entries at `positions` (None: none) pending; drop every other pending entry."""
        if self._pending_count[seq_id] == 0:
            return  # nothing pending
        row, pending = self._pending(seq_id)
        drop = pending if positions is None else pending & ~torch.isin(self.pos[row, :self.used], positions)
        self.owner[row, :self.used].masked_fill_(drop, EMPTY)
        self._pending_count[seq_id] = 0 if positions is None else None  # several groups may hold a position
        self._dirty = True

    def discard(self, seq_id: int) -> None:
        """Drop every pending entry of a sequence: its cache is exactly its context again."""
        self.retain(seq_id, None)

    def check(self, seq_id: int) -> None:
        """Assert the invariant: the context entries are exactly the committed tokens."""
        row = self.row_of[seq_id]
        n = int((self.owner[row, :self.used] == CONTEXT).sum())
        if n != self.committed[seq_id]:
            raise RuntimeError(f"KV cache invariant broken: {n} context entries for {self.committed[seq_id]} tokens")
