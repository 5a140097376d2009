"""SlotCache on small hand-built cases: rows, forwards, who sees whom, commit / retain / discard, compaction,
growth and the invariant. KV entries are fake: key = (position, group it was written by), value = -key, so
that we can check they move with their metadata."""

import pytest
import torch

from refusion.decode.cache import CHECK_ENV, CONTEXT, EMPTY, PADDING, SlotCache, checks_by_default

P = PADDING


def make_cache(n_sequences: int = 1, capacity: int = 16, layers: int = 2, **kwargs) -> SlotCache:
    cache = SlotCache(layers, "cpu", capacity=capacity, **kwargs)
    for s in range(n_sequences):
        cache.add_sequence(s)
    return cache


def forward(cache: SlotCache, groups, positions, lower_upto=None, counted: bool = False):
    """One forward: reserve columns, write fake KV on every layer, account. Returns the mask. `counted`: tell the
    cache each row's tokens that are not padding (what the decoder does)."""
    counts = [sum(g != P for g in row) for row in groups] if counted else None
    groups, positions = torch.tensor(groups), torch.tensor(positions)  # [B, T]
    lower = None if lower_upto is None else torch.tensor(lower_upto)
    mask = cache.begin_forward(groups, positions, lower, counts)
    key = torch.stack([positions, groups], -1)[:, None].float()  # [B, 1, T, 2]
    for layer in cache.hf.layers:
        keys, values = layer.update(key, -key, 0)
        assert keys.shape[2] == cache.used + groups.shape[1]  # the layer sees every column written so far
    cache.end_forward()
    return mask


def seen(mask, row: int = 0) -> list[list[int]]:
    """[T, L] 0/1 visibility of one row."""
    return mask[row, 0].long().tolist()


def live(cache: SlotCache, row: int = 0) -> list[tuple[int, int]]:
    """(owner, position) of each live column of a row, in column order."""
    return [(int(o), int(p)) for o, p in zip(cache.owner[row, :cache.used], cache.pos[row, :cache.used]) if o != EMPTY]


def assert_kv_follows_metadata(cache: SlotCache) -> None:
    """Every live column still holds the KV written for its position (fake key[..., 0] = position)."""
    for row in range(cache.batch_size):
        for col in range(cache.used):
            if cache.owner[row, col] != EMPTY:
                for keys, values in zip(cache.keys, cache.values):
                    assert keys[row, 0, col, 0] == cache.pos[row, col]
                    assert torch.equal(values[row, 0, col], -keys[row, 0, col])


def prefill(cache: SlotCache, length: int, seq: int = 0) -> None:
    """A one-row forward of `length` prompt tokens, committed."""
    forward(cache, [[0] * length], [list(range(length))])
    cache.commit(seq, torch.arange(length))


# ------------------------------------------------------------------------------------------- rows
def test_add_and_remove_sequences():
    cache = make_cache(3)
    assert cache.batch_size == 3 and cache.row_of == {0: 0, 1: 1, 2: 2}
    forward(cache, [[0, 0], [0, 0], [0, 0]], [[0, 1], [5, 6], [7, 8]])
    cache.remove_sequences([1])
    assert cache.row_of == {0: 0, 2: 1} and cache.batch_size == 2
    assert cache.pos[:, :2].tolist() == [[0, 1], [7, 8]]  # the last row's entries moved into the freed row
    assert_kv_follows_metadata(cache)
    cache.add_sequence(3)  # joins with an empty row
    cache.add_sequence(4)
    assert cache.row_of == {0: 0, 2: 1, 3: 2, 4: 3} and (cache.owner[2:] == EMPTY).all()
    assert cache.keys[0].shape[0] == 2  # the KV rows of sequences that join together are added at one go...
    forward(cache, [[0, 0]] * 4, [[2, 3], [9, 10], [0, 1], [0, 1]])
    assert cache.keys[0].shape[0] == 4  # ...when the buffers are next used
    assert cache.pos[:, :4].tolist() == [[0, 1, 2, 3], [7, 8, 9, 10], [0, 0, 0, 1], [0, 0, 0, 1]]
    assert_kv_follows_metadata(cache)
    cache.add_sequence(5)
    cache.remove_sequences([0, 5])  # removing rows the buffers have not caught up with yet
    assert cache.row_of == {4: 0, 2: 1, 3: 2} and cache.keys[0].shape[0] == 3  # the last live row moved into row 0
    assert cache.pos[:, :4].tolist() == [[0, 0, 0, 1], [7, 8, 9, 10], [0, 0, 0, 1]]
    assert_kv_follows_metadata(cache)
    cache.remove_sequences([2, 3, 4])
    assert cache.batch_size == 0 and cache.used == 0


def test_a_sequence_that_joins_takes_a_freed_row_without_copying_the_buffers():
    cache = make_cache(3)
    forward(cache, [[0, 0], [0, 0], [0, 0]], [[0, 1], [5, 6], [7, 8]])
    for s, positions in enumerate([[0, 1], [5, 6], [7, 8]]):
        cache.commit(s, torch.tensor(positions))
    buffers = [k.data_ptr() for k in cache.keys]
    cache.remove_sequences([0])
    cache.add_sequence(3)
    mask = forward(cache, [[0], [0], [0]], [[9], [7], [0]])
    assert [k.data_ptr() for k in cache.keys] == buffers  # the same storage: nothing was copied to make room
    assert cache.row_of == {2: 0, 1: 1, 3: 2}
    assert seen(mask, 2) == [[0, 0, 1]]  # the joining row sees none of the entries its row held before
    assert live(cache, 2) == [(0, 0)] and live(cache, 0) == [(CONTEXT, 7), (CONTEXT, 8), (0, 9)]
    assert_kv_follows_metadata(cache)


def test_removing_several_rows_keeps_every_other_sequence_s_entries():
    cache = make_cache(7)
    forward(cache, [[0]] * 7, [[10 * s] for s in range(7)])
    cache.remove_sequences([5, 0, 3, 6])  # the last row and rows the moves fill in turn
    assert sorted(cache.row_of) == [1, 2, 4] and sorted(cache.row_of.values()) == [0, 1, 2]
    assert all(cache.pos[row, 0] == 10 * s for s, row in cache.row_of.items())
    assert_kv_follows_metadata(cache)


def test_rows_written_in_a_step_are_freed_and_filled_outside_one():
    cache = make_cache(2)
    with torch.inference_mode():  # as the decoder's step: the buffers are inference tensors
        forward(cache, [[0, 0], [0, 0]], [[0, 1], [0, 1]])
        cache.commit(0, torch.tensor([0, 1]))
        keys, values = cache.context_entries(0, 0, 2)
    cache.remove_sequences([0])  # a client that went away, between steps
    cache.add_sequence(2)  # a request that joins with a cached prompt prefix
    cache.add_context(2, torch.tensor([0, 1]), keys, values)
    assert live(cache, 1) == [(CONTEXT, 0), (CONTEXT, 1)]
    assert_kv_follows_metadata(cache)


def test_a_sequence_gets_one_row():
    cache = make_cache(1)
    with pytest.raises(AssertionError):
        cache.add_sequence(0)


# ------------------------------------------------------------------------------------------- forwards
def test_begin_forward_reserves_columns_and_end_forward_accounts_them():
    cache = make_cache(2)
    cache.begin_forward(torch.tensor([[P, 0], [0, 0]]), torch.tensor([[0, 0], [0, 1]]))
    assert cache.used == 0  # nothing accounted while the forward is in flight
    assert cache.owner[:, :2].tolist() == [[P, 0], [0, 0]]
    for layer in cache.hf.layers:
        layer.update(torch.zeros(2, 1, 2, 2), torch.zeros(2, 1, 2, 2), 0)
    cache.end_forward()
    assert cache.used == 2
    assert cache.owner[:, :2].tolist() == [[EMPTY, 0], [0, 0]]  # padding columns become free


def test_prefill_is_causal():
    cache = make_cache(1)
    mask = forward(cache, [[0, 0, 0]], [[0, 1, 2]])
    assert seen(mask) == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_context_is_visible_to_every_group_and_groups_never_see_each_other():
    cache = make_cache(1)
    prefill(cache, 2)
    # groups 0 and 1 each write positions 2, 3 (two rows of parallel completion)
    mask = forward(cache, [[0, 0, 1, 1]], [[2, 3, 2, 3]])
    assert seen(mask) == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],
    ]
    # a later forward: each group sees its own pending entries from before, never the other's
    mask = forward(cache, [[0, 1]], [[4, 4]])
    assert seen(mask) == [
        [1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1, 0, 1],
    ]


def test_padding_is_invisible():
    cache = make_cache(2)
    mask = forward(cache, [[P, 0, 0], [0, 0, 0]], [[0, 0, 1], [0, 1, 2]])
    assert seen(mask, 0) == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]  # padding sees itself only (no empty rows)
    cache.commit(0, torch.arange(2))
    cache.commit(1, torch.arange(3))
    mask = forward(cache, [[0], [0]], [[2], [3]])
    assert seen(mask, 0) == [[0, 1, 1, 1]]  # the old padding column stays invisible
    assert seen(mask, 1) == [[1, 1, 1, 1]]


def test_padding_sees_none_of_its_rows_context():
    """A padding query's output is dropped: it sees its row's padding alone, not the context, so exact attention
    skips the context's columns for it (padding to a batch's widest row cost as much as a real row)."""
    cache = make_cache(2)
    forward(cache, [[0, 0], [0, 0]], [[0, 1], [0, 1]])  # both prompts
    cache.commit(0, torch.arange(2))
    cache.commit(1, torch.arange(2))
    mask = forward(cache, [[P, P, 0], [0, 0, 0]], [[0, 0, 2], [2, 3, 4]])
    assert seen(mask, 0) == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert seen(mask, 1) == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_one_token_over_a_hole_free_context_needs_no_mask():
    cache = make_cache(1)
    prefill(cache, 3)
    assert forward(cache, [[0]], [[3]]) is None


def test_eager_attention_gets_an_additive_mask():
    cache = make_cache(1, mask_dtype=torch.float32)
    mask = forward(cache, [[0, 0]], [[0, 1]])
    low = torch.finfo(torch.float32).min
    assert mask[0, 0].tolist() == [[0.0, low], [0.0, 0.0]]


def test_lower_upto_reads_lower_groups_up_to_a_position():
    cache = make_cache(1)
    prefill(cache, 1)
    # group 0: a chain at positions 1, 2, 3; group 1: masks after position 2; group 2: masks after position 1
    groups = [[0, 0, 0, 1, 1, 2]]
    positions = [[1, 2, 3, 3, 4, 2]]
    lower_upto = [[-1, -1, -1, 2, 2, 1]]
    mask = forward(cache, groups, positions, lower_upto)
    assert seen(mask) == [
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],  # group 1 reads group 0 at positions <= 2, not position 3
        [1, 1, 1, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 0, 1],  # group 2 reads group 0 up to position 1 only, and never the higher group 1
    ]


def test_lower_upto_never_reads_higher_groups():
    cache = make_cache(1)
    prefill(cache, 1)
    forward(cache, [[1, 1]], [[1, 2]])  # pending entries of group 1
    mask = forward(cache, [[0, 2]], [[3, 3]], [[9, 9]])
    assert seen(mask) == [
        [1, 0, 0, 1, 0],  # group 0 reads nothing of group 1, whatever its lower_upto
        [1, 1, 1, 1, 1],  # group 2 reads every lower group: group 1's earlier entries, group 0's new token
    ]


# ------------------------------------------------------------------------------------------- pending entries
def test_commit_makes_the_chosen_entries_context_and_drops_the_rest():
    cache = make_cache(1)
    prefill(cache, 2)
    forward(cache, [[0, 0, 0]], [[2, 3, 4]])
    cache.commit(0, torch.tensor([2, 3]))
    assert live(cache) == [(CONTEXT, 0), (CONTEXT, 1), (CONTEXT, 2), (CONTEXT, 3)]
    assert cache.committed[0] == 4


def test_commit_picks_one_group_when_two_hold_a_position():
    cache = make_cache(1)
    prefill(cache, 1)
    forward(cache, [[0, 0, 1, 1]], [[1, 2, 1, 2]])
    with pytest.raises(RuntimeError, match="invariant"):
        cache.commit(0, torch.tensor([1, 2]))  # four entries hold positions 1, 2
    cache = make_cache(1)
    prefill(cache, 1)
    forward(cache, [[0, 0, 1, 1]], [[1, 2, 1, 2]])
    cache.commit(0, torch.tensor([1, 2]), group=1)
    assert live(cache) == [(CONTEXT, 0), (CONTEXT, 1), (CONTEXT, 2)]
    assert [int(cache.keys[0][0, 0, c, 1]) for c in range(cache.used) if cache.owner[0, c] == CONTEXT] == [0, 1, 1]


def test_commit_takes_each_position_from_its_own_group():
    """A second draft chain (group 1) beside the first (group 0) over the same positions: the next token from the
    first, the rest from the second."""
    cache = make_cache(1)
    prefill(cache, 1)
    forward(cache, [[0, 0, 0, 1, 1]], [[1, 2, 3, 2, 3]])
    cache.commit(0, torch.tensor([1, 2, 3]), group=torch.tensor([0, 1, 1]))
    assert live(cache) == [(CONTEXT, 0), (CONTEXT, 1), (CONTEXT, 2), (CONTEXT, 3)]
    assert [int(cache.keys[0][0, 0, c, 1]) for c in range(cache.used) if cache.owner[0, c] == CONTEXT] == [0, 0, 1, 1]
    assert cache.committed[0] == 4


def test_commit_of_a_missing_position_breaks_the_invariant():
    cache = make_cache(1)
    prefill(cache, 2)
    forward(cache, [[0]], [[2]])
    with pytest.raises(RuntimeError, match="committing 2 tokens, found 1"):
        cache.commit(0, torch.tensor([2, 3]))


def test_retain_keeps_some_pending_entries_and_discard_drops_all():
    cache = make_cache(1)
    prefill(cache, 1)
    forward(cache, [[0, 0, 1, 1]], [[1, 2, 1, 2]])
    cache.retain(0, torch.tensor([1]))
    assert live(cache) == [(CONTEXT, 0), (0, 1), (1, 1)]  # position 1 kept in both groups
    cache.retain(0, None)
    assert live(cache) == [(CONTEXT, 0)]
    forward(cache, [[0]], [[1]])
    cache.discard(0)
    assert live(cache) == [(CONTEXT, 0)] and cache.committed[0] == 1


def test_pending_verbs_touch_only_their_own_row():
    cache = make_cache(2)
    forward(cache, [[0, 0], [0, 0]], [[0, 1], [0, 1]])
    cache.commit(0, torch.tensor([0]))
    cache.discard(1)
    assert live(cache, 0) == [(CONTEXT, 0)] and live(cache, 1) == []


def test_columns_after_the_last_entry_are_reused():
    """Drafts dropped at the end of the buffer leave no hole: the next forward writes where they were, so a
    sequence decoded alone keeps its context in position order, in the columns AR decoding uses."""
    cache = make_cache(1)
    prefill(cache, 3)
    forward(cache, [[0, 0, 0, 0]], [[3, 4, 5, 6]])
    cache.commit(0, torch.tensor([3, 4]))  # 5 and 6 dropped: the last two columns
    forward(cache, [[0]], [[5]])
    assert cache.used == 6 and live(cache) == [(CONTEXT, p) for p in range(5)] + [(0, 5)]
    assert (cache.owner[0, :6] != EMPTY).all()
    assert_kv_follows_metadata(cache)
    # in a batch, columns another row still uses are kept (and the row that dropped them has a hole)
    cache = make_cache(2)
    forward(cache, [[0, 0, 0], [0, 0, 0]], [[0, 1, 2], [0, 1, 2]])
    cache.commit(0, torch.tensor([0, 1, 2]))
    cache.commit(1, torch.tensor([0]))
    forward(cache, [[0], [0]], [[3], [1]])
    assert cache.used == 4 and live(cache, 1) == [(CONTEXT, 0), (0, 1)]
    assert_kv_follows_metadata(cache)


# ------------------------------------------------------------------------------------------- space
@pytest.mark.parametrize("by_row", [True, False], ids=["row by row (CPU)", "one gather (accelerator)"])
def test_compaction_moves_live_entries_to_the_front_with_their_kv(by_row):
    cache = make_cache(2)
    cache.compacts_by_row = by_row
    forward(cache, [[0, 0, 0, 0], [P, P, 0, 0]], [[0, 1, 2, 3], [0, 0, 0, 1]])
    cache.commit(0, torch.tensor([0, 1, 2, 3]))
    cache.commit(1, torch.tensor([0, 1]))
    forward(cache, [[0, 0, 1], [0, 1, 1]], [[4, 5, 4], [2, 2, 3]])
    cache.retain(0, torch.tensor([4]))  # drops (0, 5)
    cache.retain(1, torch.tensor([2, 3]))
    before = [live(cache, r) for r in range(2)]
    cache.compact()
    assert cache.used == 6  # row 0: 4 context + 2 pending
    assert [live(cache, r) for r in range(2)] == before  # same entries, same order, holes gone
    assert (cache.owner[0, :6] != EMPTY).all() and (cache.owner[1, 5:] == EMPTY).all()
    assert_kv_follows_metadata(cache)
    mask = forward(cache, [[1], [1]], [[5], [4]])  # visibility is unchanged by the move
    assert seen(mask, 0) == [[1, 1, 1, 1, 0, 1, 1]]
    assert seen(mask, 1) == [[1, 1, 0, 1, 1, 0, 1]]


def test_a_full_buffer_is_compacted_before_it_grows():
    cache = make_cache(1, capacity=6)
    prefill(cache, 2)
    forward(cache, [[0, 0, 0, 0]], [[2, 3, 4, 5]])
    cache.discard(0)  # 4 dead columns: the next forward fits after compaction
    forward(cache, [[0, 0, 0]], [[2, 3, 4]])
    assert cache.capacity == 6 and cache.used == 5
    assert live(cache) == [(CONTEXT, 0), (CONTEXT, 1), (0, 2), (0, 3), (0, 4)]
    assert_kv_follows_metadata(cache)


def test_a_full_buffer_whose_compaction_would_free_little_grows_instead():
    """Full with one dead column of 16 (less than an eighth), a forward of 2 makes the buffer grow without copying it
    first (compacting would free too little to last); with two dead (an eighth) it is compacted and keeps its size."""
    for dead in (1, 2):
        cache = make_cache(1, capacity=16)
        prefill(cache, 13 - dead)
        drafted = list(range(13 - dead, 15))  # a forward of dead + 2 tokens: the first and last are kept
        forward(cache, [[0] * len(drafted)], [drafted])
        cache.retain(0, torch.tensor([drafted[0], drafted[-1]]))
        cache.commit(0, torch.tensor([drafted[0], drafted[-1]]))
        assert cache.used == 15
        compacted = []
        compact = cache.compact
        cache.compact = lambda: compacted.append(True) or compact()  # noqa: B023
        forward(cache, [[0, 0]], [[15, 16]])
        assert (cache.capacity, compacted) == ((24, []) if dead == 1 else (16, [True]))
        assert_kv_follows_metadata(cache)


def test_growth_keeps_every_entry():
    cache = make_cache(2, capacity=4)
    prefill(cache, 3, seq=0)
    cache.discard(1)
    forward(cache, [[0, 0, 0], [0, 0, 0]], [[3, 4, 5], [0, 1, 2]])
    assert cache.capacity == 6  # max(used + width, 1.5 * capacity)
    assert cache.keys[0].shape[2] == cache.values[1].shape[2] == cache.owner.shape[1] == cache.pos.shape[1] == 6
    assert live(cache, 0) == [(CONTEXT, 0), (CONTEXT, 1), (CONTEXT, 2), (0, 3), (0, 4), (0, 5)]
    assert_kv_follows_metadata(cache)
    cache.commit(0, torch.tensor([3, 4, 5]))
    assert cache.committed[0] == 6


# ------------------------------------------------------------------------------------------- reads back
def counting_reads(cache: SlotCache) -> list[int]:
    """A list that grows by one each time the cache reads its metadata back to the host."""
    reads, read = [], cache._read_metadata

    def counted():
        reads.append(1)
        return read()
    cache._read_metadata = counted
    return reads


def test_ar_decoding_reads_nothing_back_until_an_entry_is_dropped():
    cache = make_cache(1, capacity=32)
    reads = counting_reads(cache)
    forward(cache, [[0] * 3], [[0, 1, 2]], counted=True)
    cache.commit(0, torch.arange(3))
    for p in range(3, 8):  # one token a forward, each committed: the context stays hole-free
        assert forward(cache, [[0]], [[p]], counted=True) is None
        cache.commit(0, torch.tensor([p]))
    assert reads == [] and cache.used == 8
    forward(cache, [[0, 0, 0]], [[8, 9, 10]], counted=True)
    cache.commit(0, torch.tensor([8]))  # two drafts dropped: the next forward looks, and reuses their columns
    assert forward(cache, [[0]], [[9]], counted=True) is None
    assert reads == [1] and cache.used == 10
    assert live(cache) == [(CONTEXT, p) for p in range(9)] + [(0, 9)]


@pytest.mark.parametrize("seed", range(4))
def test_the_host_counts_agree_with_reading_everything_back(seed):
    """Random forwards (padded, in two groups), commits, retains and discards on two caches, one told each row's
    token counts (it reads back only when it must) and one not (it reads back before every forward): the same
    entries in the same columns and the same masks, and the host's pending counts match the device's."""
    gen = torch.Generator().manual_seed(seed)
    told, untold = make_cache(2, capacity=12), make_cache(2, capacity=12)
    fresh = [0, 0]  # each row's next unused position
    pending: list[list[tuple[int, int]]] = [[], []]  # (group, position) of each row's pending entries

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    for _ in range(40):
        width = 1 + draw(4)
        groups, positions = [], []
        for row in range(2):
            n = draw(width + 1) if row else width
            new = sorted(draw(2) for _ in range(n))
            groups.append([P] * (width - n) + new)
            positions.append([0] * (width - n) + list(range(fresh[row], fresh[row] + n)))
            pending[row] += list(zip(new, positions[row][width - n:]))
            fresh[row] += n
        masks = [forward(cache, groups, positions, counted=cache is told) for cache in (told, untold)]
        assert (masks[0] is None) == (masks[1] is None) and (masks[0] is None or torch.equal(*masks))
        for row in range(2):
            verb = draw(3)
            if verb == 2 and pending[row]:  # commit one group's pending entries, drop the others
                group = pending[row][draw(len(pending[row]))][0]
                kept = [p for g, p in pending[row] if g == group]
                for cache in (told, untold):
                    cache.commit(row, torch.tensor(kept), group=group)
                pending[row] = []
            elif verb == 1 and pending[row]:  # keep some positions pending
                kept = [p for _, p in pending[row] if draw(2)]
                for cache in (told, untold):
                    cache.retain(row, torch.tensor(kept, dtype=torch.long))
                pending[row] = [(g, p) for g, p in pending[row] if p in kept]
            else:
                for cache in (told, untold):
                    cache.discard(row)
                pending[row] = []
            assert live(told, row) == live(untold, row)
            assert told._pending_count[row] in (None, len(pending[row]))
        assert told.used == untold.used and torch.equal(told.owner, untold.owner) and torch.equal(told.pos, untold.pos)


# ------------------------------------------------------------------------------------------- invariant
# ------------------------------------------------------------------------------------------- prompt prefixes
def test_context_entries_come_out_in_position_order_and_go_into_another_row_as_context():
    cache = make_cache(2)
    forward(cache, [[0, 0, 0, 0], [P, P, 0, 0]], [[0, 1, 2, 3], [0, 0, 0, 1]])
    cache.commit(0, torch.tensor([0, 1, 2, 3]))
    cache.commit(1, torch.tensor([0, 1]))
    forward(cache, [[P, 0], [0, 0]], [[0, 5], [2, 3]])
    cache.discard(0)
    keys, values = cache.context_entries(0, 1, 3)
    assert [k.shape for k in keys] == [torch.Size([1, 2, 2])] * 2  # per layer [kv_heads, n, head_dim]
    assert keys[0][0, :, 0].tolist() == [1.0, 2.0] and torch.equal(values[1], -keys[1])
    with pytest.raises(RuntimeError, match="2 context entries at positions \\[2, 5\\)"):
        cache.context_entries(0, 2, 5)  # position 4 is not in the context
    cache.add_sequence(7)
    cache.add_context(7, torch.tensor([1, 2]), keys, values)  # (as if positions 1 and 2 began its prompt)
    assert cache.committed[7] == 2
    cache.check(7)
    assert live(cache, 2) == [(CONTEXT, 1), (CONTEXT, 2)]
    assert_kv_follows_metadata(cache)
    assert live(cache, 0)[-1] == (CONTEXT, 3)  # the other rows are untouched
    mask = forward(cache, [[P], [P], [0]], [[0], [0], [3]])  # the new row's first forward sees exactly them
    visible = [c for c, s in enumerate(seen(mask, 2)[0]) if s]
    assert [int(cache.pos[2, c]) for c in visible] == [1, 2, 3]
    cache.commit(7, torch.tensor([3]))  # the invariant holds over reused and computed entries
    assert cache.committed[7] == 3
    cache.compact()
    assert_kv_follows_metadata(cache)
    assert cache.context_entries(7, 1, 4)[0][1][0, :, 0].tolist() == [1.0, 2.0, 3.0]


def test_add_context_allocates_buffers_and_converts_to_the_kept_dtype():
    cache = make_cache(1, kv_dtype=torch.float64)
    keys = [torch.tensor([[[0.0, 0.0], [1.0, 0.0]]], dtype=torch.bfloat16)] * 2
    cache.add_context(0, torch.tensor([0, 1]), keys, [-k for k in keys])
    assert cache.keys[0].dtype == torch.float64 and cache.committed[0] == 2
    forward(cache, [[0]], [[2]])
    cache.commit(0, torch.tensor([2]))
    assert_kv_follows_metadata(cache)
    with pytest.raises(ValueError, match="fixed-shape"):
        make_cache(1, static=(1, 2, torch.float32)).add_context(0, torch.tensor([0]), keys, keys)


def test_check_compares_context_entries_with_committed_tokens():
    cache = make_cache(1)
    prefill(cache, 3)
    cache.check(0)
    cache.committed[0] += 1  # a token committed without its KV
    with pytest.raises(RuntimeError, match="4 tokens"):
        cache.check(0)


def test_a_sliding_window_hides_keys_by_position_not_column():
    cache = make_cache(1, windows={"sliding_attention": 2})
    forward(cache, [[0, 0, 0, 0]], [[0, 1, 6, 7]])  # a prompt, then a slot committed ahead of the text between
    cache.commit(0, torch.tensor([0, 1, 6, 7]))
    mask = forward(cache, [[0, 0]], [[2, 3]])
    assert seen(mask) == [
        [0, 1, 1, 1, 1, 0],  # position 2 reads 1 (2 - 1 < 2), not 0; later positions are not windowed
        [0, 0, 1, 1, 1, 1],
    ]
    assert forward(cache, [[0]], [[4]]) is not None  # windowed models always get a mask


def test_the_invariant_is_checked_only_when_asked(monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)
    assert not SlotCache(1, "cpu").check_invariants and not checks_by_default()
    monkeypatch.setenv(CHECK_ENV, "1")
    assert checks_by_default() and SlotCache(1, "cpu").check_invariants
    unchecked = SlotCache(1, "cpu", check_invariants=False)
    unchecked.add_sequence(0)
    unchecked.begin_forward(torch.tensor([[0, 0]]), torch.tensor([[0, 1]]))
    unchecked.end_forward()
    unchecked.commit(0, torch.tensor([0, 1]))  # committing by masked writes, the count kept on the host
    assert unchecked.committed[0] == 2 and (unchecked.owner[0, :2] == CONTEXT).all()
