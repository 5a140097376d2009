"""What a wider forward costs, and how many drafts are worth verifying at that price.

The exact mode verifies chains of drafted tokens. Every accepted draft saves a forward, but every draft also widens
the forward, and what width costs depends on the kernels: packed bf16 products on an AMX CPU cost about the same for
1 and 16 rows, the int4 kernel computes row by row (a 16-row forward of the embedded model costs ~2x a one-row one),
and a GPU should pay little for it (not measured yet). So how far each sequence drafts is chosen from two
measurements:

* `ForwardCosts`: seconds of a batch-1 decoding forward of each width after a cached context, and what each padding
  row and the mask add to a batched forward (sequences are padded to the widest, and attention runs over the padded
  layout: on the embedded model a padding row costs ~0.4x a real one), timed once per machine and model (`measure`)
  and recorded (`model.calibration`): every later process reads the record
  (`forward_costs_of`, called by the decoder), so the draft counts, and with them the forward counts, are the
  same in every process however busy the machine is;
* how often drafts were accepted (`decode/acceptance.py`): per sequence and drafter, at each depth
  (`AcceptanceByDepth`), or, for the draft table's drafts, per tenth of the frequency the table states for each
  (`AcceptanceByFrequency`), which every drafter turns into its proposal's chances.

`draft_counts` decides once per step, for every sequence of the batch together, which drafts the step's forward
verifies: those that maximize the batch's expected committed tokens per second of that forward, its cost counted
over every sequence's rows and the padding to the widest; where none pays, every sequence takes a plain AR step. For one sequence with one chain it
gives `best_draft_count`'s count n, the one that maximizes (1 + sum over i <= n of the chance that the first i drafts
are accepted) / cost(n + 1). Verifying fewer drafts never changes what is committed (the exact mode commits AR
decoding's tokens whatever it drafts), only how fast.

Fused planning trades the same way: the next round's plan rides on a forward that may end this round, which
saves the plan's own forward only when the round commits everything it selected. `fusing_pays` appends it when
the extra width costs less than what the plan would cost on its own times the chance (`SuccessRate`) that it is
used. In a batch, every sequence's rows share the forward, so the widths are counted over the batch (B sequences
of w tokens: a forward of B·w rows, each request padded to the widest), and a plan that is not fused rarely costs
a forward of its own: it usually shares a step that the other sequences take anyway, padding their requests to the
plan's width. So the saving is priced as a whole plan forward with chance 1/B (the batch planning in step) and as
that padding otherwise: at batch 1 a whole forward, as before; in a batch on a CPU, where rows cost compute, fusing
stops paying (it lost to the unfused engine at batch 4: docs/archive/RESULTS-LEDGER.md: *Engine vs the
authors' reference script*), while where width is nearly free (a GPU) it still does.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, replace

import torch

from refusion.decode.acceptance import AcceptanceByDepth
from refusion.model import calibration
from refusion.model.calibration import ForwardCosts

PROBE_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64)
"""Forward widths `measure` times; other widths are interpolated (linearly, and beyond the last one extrapolated).
Every width up to 8: the linear kernels change form and padding between row counts (on E5, fp32: 5 and 6 rows cost
1.3-1.6x 4 rows, and 7 cost less than 6, where interpolating 4 and 8 priced them at ~1.1x), and a batch of one-token
steps with a draft or two is exactly such a forward.
64: a batch's forward counts every sequence's rows, and extrapolating from 16-32 rows, where the weights' bytes
still dominate, priced wider forwards too low, so that batched fused planning was chosen where it lost (docs/
archive/RESULTS-LEDGER.md: *Engine vs the authors' reference script*); it costs the embedded model ~0.24 s
more per load."""
PROBE_REPEATS = 3
"""Timed forwards per width, after one untimed round; the fastest counts: a forward slowed by another process or
the OS says nothing about the kernels, and one such forward in a median of two priced drafts too high for the whole
process (docs/archive/RESULTS-LEDGER.md: *Cost-aware drafts*)."""
PROBE_CONTEXT = 128
"""Tokens of cached context before the timed forwards (a prompt and part of its answer): each new row attends over
them, a cost that grows with width (on refusion-smol in row-exact bf16 on an AVX512-BF16 EPYC, a 16-token decoding
forward costs 1.7x a one-token one, where forwards without a context measured 1.2x: docs/BENCHMARKS.md, Current
results: *Forward costs with a context*)."""
PROBE_VERSION = 7
"""Part of the record's key: bump when `measure` changes what it reports, so that older records are measured again.
2: the one-token forward that decides whether to probe at all is timed after an untimed one (a process's first
forward, which sets its kernels up, took over MAX_PROBE_SECONDS for the embedded model, and None was recorded: no
draft was ever priced). 3: a one-token forward over MAX_PROBE_SECONDS is timed once more after another untimed one
before "not priced" is recorded (one slow forward, another process's start beside it, recorded it for good). 4: the
record names the layout the costs were timed on (`ForwardCosts.probe_context`, `probe_batch`) and what a row pays
per column beyond it (`attention`, timed over LONG_PROBE_CONTEXT), which a step's cost scales by its own layout.
5: whether the forward runs attention row by row over a padded batch's real queries (`split_attention`: the
padding's `padded_row` is then timed with it). 6: `attention` from forwards after the two contexts interleaved,
the long one 1,024 tokens; every width up to 8 timed. 7: widths that run backwards pooled (`non_decreasing`)
instead of raised to the slowest narrower one."""
LONG_PROBE_CONTEXT = 1024
"""The longer cached context over which a PAD_PROBE_WIDTH-token forward is timed beside one over PROBE_CONTEXT: what
each row pays per column beyond PROBE_CONTEXT (`ForwardCosts.attention`), as a batch's rows do over its whole
layout (1,024: the difference, ~20 ms on E5, stands above the noise of a ~70 ms forward; 512 gave ~9 ms)."""
PAD_PROBE_BATCH = 4
"""Sequences of the forwards that time padding (`batch_extras`)."""
PAD_PROBE_WIDTH = 16
"""The widest sequence's tokens in the forward that times padding: the others are padded to it."""
MAX_PROBE_SECONDS = 0.25
"""A model whose one-token forward takes longer than this (twice, the second after another untimed forward) is not
probed (its forwards are bound by reading the weights, so width is nearly free: no cut)."""
NOT_PRICED = "drafts not priced: a one-token forward took over MAX_PROBE_SECONDS, every draft is verified"
"""What the log and the setup line (`ModelSetup.describe`) say where the forward costs are None."""

_log = logging.getLogger("refusion")


_known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {its setup's key: costs}, this process


def forward_costs_of(model, setup) -> ForwardCosts | None:
    """The forward costs that price the exact mode's drafts for `model` decoded with `setup`: `setup.forward_costs`
    when set; else, where `setup.recorded_costs`, the costs recorded for this machine and model (measured once, the
    first time, by `measure`, and recorded: `model.calibration`); else None (every draft is verified)."""
    if setup.forward_costs is not None or not setup.recorded_costs:
        return setup.forward_costs
    known = _known.setdefault(model, {})
    key = (setup.kernels, setup.compact, setup.adapter_gate)
    if key not in known:
        known[key] = recorded_costs(model, setup)
    return known[key]


def recorded_costs(model, setup) -> ForwardCosts | None:
    """`measure(model, setup)` as recorded for this machine and model (measured and recorded when absent)."""
    from refusion.model.kernels.extension import native_tag

    device = next(model.parameters()).device
    key = {"model": calibration.structure_key(model), "kernels": [setup.kernels.linear, setup.kernels.attention],
           "compact": setup.compact, "native": native_tag(), "device": str(device),
           "accelerator": calibration.device_key(device),
           "probe": {"widths": list(PROBE_WIDTHS), "repeats": PROBE_REPEATS, "context": PROBE_CONTEXT,
                     "padding": [PAD_PROBE_BATCH, PAD_PROBE_WIDTH], "long_context": LONG_PROBE_CONTEXT,
                     "max_seconds": MAX_PROBE_SECONDS,
                     "version": PROBE_VERSION}}

    def measured() -> dict | None:
        costs = measure(model, setup)
        return costs.to_dict() if costs is not None else None

    return calibration.recorded("forward_costs", key, measured, parse=parse_costs)


def parse_costs(value) -> ForwardCosts | None:
    """The `ForwardCosts` of a recorded value (None: not priced); a ValueError or TypeError for a value of the wrong
    type or range (`ForwardCosts.from_dict`)."""
    return ForwardCosts.from_dict(value) if value is not None else None


@torch.inference_mode()
def measure(model, setup, widths: tuple[int, ...] = PROBE_WIDTHS, repeats: int = PROBE_REPEATS,
            context: int = PROBE_CONTEXT) -> ForwardCosts | None:
    """Time batch-1 forwards of `widths` new tokens after a cached context of `context` tokens, through the
    decoding forward (`decode.forward`) that `setup` (the model's `ModelSetup`) gives, eager: its compact or native
    layers, its KV cache and masks, so what a decoding step of that width pays, attention over the context
    included. None when a one-token forward takes longer than MAX_PROBE_SECONDS (`fast_enough`: twice). After an
    untimed round (kernels pick their code for each shape on first use), widths are timed in turn, `repeats`
    rounds, so that a drift of the machine touches them all alike; each width's fastest forward counts."""
    from refusion.decode.forward import CachedForward

    run = CachedForward(model, setup.replace(compiled=None))
    cache = run.new_cache(context + max(widths) + 1)
    device, vocab = run.device, model.get_input_embeddings().num_embeddings
    ids = torch.arange(context + max(widths), device=device).remainder(vocab)  # no mask token: clean rows
    cache.add_sequence(0)

    def forward(start: int, width: int) -> float:  # logits of every row, as a decoding forward of drafts has
        positions = torch.arange(start, start + width, device=device)[None]
        begin = time.perf_counter()
        run(cache, ids[None, start: start + width], positions, torch.zeros_like(positions), None, [width], [width])
        return time.perf_counter() - begin

    if not fast_enough(forward, cache):
        return None
    if context:
        forward(0, context)
        cache.commit(0, torch.arange(context, device=device))

    def timed(width: int) -> float:
        seconds = forward(context, width)
        cache.discard(0)  # the cache holds the context alone again
        return seconds

    for w in widths:
        timed(w)
    times = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            times[w].append(timed(w))
    seconds = non_decreasing([min(times[w]) for w in widths])
    costs = ForwardCosts(tuple(widths), tuple(seconds))
    padded_row, masking = batch_extras(run, costs, vocab, repeats, context)
    attention = attention_per_column(run, vocab, repeats, context) if context else 0.0
    return replace(costs, padded_row=padded_row, masking=masking, attention=attention, probe_context=context,
                   probe_batch=PAD_PROBE_BATCH, split_attention=run.splits_attention)


def non_decreasing(seconds: list[float]) -> list[float]:
    """The closest non-decreasing times (least squares: adjacent widths that run backwards are pooled to their mean):
    a wider forward never costs less. A running maximum carried one slow width to every wider one: on a fresh E5 run
    a 3-token forward timed at 53 ms priced 3 to 12 tokens alike, and the README's command verified half the drafts."""
    pools: list[list[float]] = []  # [sum, count]
    for value in seconds:
        pools.append([value, 1])
        while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    return [total / count for total, count in pools for _ in range(int(count))]


def attention_per_column(run, vocab: int, repeats: int = PROBE_REPEATS, context: int = PROBE_CONTEXT,
                         long_context: int = LONG_PROBE_CONTEXT, width: int = PAD_PROBE_WIDTH) -> float:
    """Seconds a row pays per cached column beyond `context`: a `width`-token forward after `context` cached tokens
    and one after `long_context`, interleaved `repeats` times after an untimed round (a drift of the machine touches
    both alike), the fastest of each; their difference per row and extra column, not below 0. On E5, where the cost
    is ~1.5-2 µs, this still recorded 0 in one of three server-side probes (and the earlier probe, the long context
    timed apart from the short one, in two): a record of 0 prices long layouts too low until `refusion calibrate`."""
    device = run.device
    ids = torch.arange(long_context + width, device=device).remainder(vocab)
    positions = torch.arange(long_context + width, device=device)[None]
    caches = []
    for cached in (context, long_context):
        cache = run.new_cache(cached + width + 1)
        cache.add_sequence(0)
        run(cache, ids[None, :cached], positions[:, :cached], torch.zeros_like(positions[:, :cached]), None,
            [cached], [cached])
        cache.commit(0, torch.arange(cached, device=device))
        caches.append((cached, cache))

    def forward(cached: int, cache) -> float:
        begin = time.perf_counter()
        run(cache, ids[None, cached: cached + width], positions[:, cached: cached + width],
            torch.zeros_like(positions[:, :width]), None, [width], [width])
        seconds = time.perf_counter() - begin
        cache.discard(0)
        return seconds

    times: list[list[float]] = [[], []]
    for round_ in range(repeats + 1):
        for i, (cached, cache) in enumerate(caches):
            seconds = forward(cached, cache)
            if round_:
                times[i].append(seconds)
    short, long = min(times[0]), min(times[1])
    return max(long - short, 0.0) / (width * (long_context - context))


def fast_enough(forward, cache) -> bool:
    """Whether a one-token forward takes at most MAX_PROBE_SECONDS: timed after an untimed one (a process's first
    forward also pays for setting its kernels up), and once more after another untimed one when it took longer (a
    forward slowed by another process starting beside it). When neither is fast enough, says so in the log."""
    seconds = []
    for _ in range(2):
        for timed in (False, True):
            took = forward(0, 1)
            cache.discard(0)
            if timed:
                seconds.append(took)
        if seconds[-1] <= MAX_PROBE_SECONDS:
            return True
    _log.warning("refusion: %s (%s s, twice; `refusion calibrate` measures again)", NOT_PRICED,
                 " and ".join(f"{s:.2f}" for s in seconds))
    return False


def batch_extras(run, costs: ForwardCosts, vocab: int, repeats: int = PROBE_REPEATS, context: int = PROBE_CONTEXT,
                 batch: int = PAD_PROBE_BATCH, width: int = PAD_PROBE_WIDTH) -> tuple[float, float]:
    """(padding row, masking): what a batched forward pays beyond its real rows (`costs`, timed at batch 1).
    `batch` sequences after `context` cached tokens each are timed with one token each (an AR step: no mask), then
    with the first holding 2 tokens, then `width` (the others padded to it), interleaved `repeats` times after an
    untimed round, fastest of each. The padding row: what the third adds beyond the second and their extra real rows,
    per extra padding row; masking: what the second adds beyond the first, its one more real row and its padding.
    Neither below 0."""
    from refusion.decode.forward import padded_inputs
    from refusion.decode.sequence import Forward

    device = run.device
    cache = run.new_cache(context + width + 1)
    for b in range(batch):
        cache.add_sequence(b)
    ids = torch.arange(context + width, device=device).remainder(vocab)
    zeros = torch.zeros(context + width, dtype=torch.long, device=device)

    def forward(start: int, counts: list[int]) -> float:  # laid out as the decoder lays a batch out
        requests = [Forward(ids[start: start + n], torch.arange(start, start + n, device=device), zeros[:n])
                    for n in counts]
        inputs = padded_inputs(requests, max(counts), False, device)
        begin = time.perf_counter()
        run(cache, *inputs, counts, counts)
        return time.perf_counter() - begin

    if context:
        forward(0, [context] * batch)
        for b in range(batch):
            cache.commit(b, torch.arange(context, device=device))
    shapes = ([1] * batch, [2] + [1] * (batch - 1), [width] + [1] * (batch - 1))
    times: list[list[float]] = [[] for _ in shapes]
    for round_ in range(repeats + 1):
        for i, counts in enumerate(shapes):
            seconds = forward(context, counts)
            for b in range(batch):
                cache.discard(b)
            if round_:
                times[i].append(seconds)
    plain, two, wide = (min(t) for t in times)
    rows = [sum(counts) for counts in shapes]
    padding = [batch * max(counts) - n for counts, n in zip(shapes, rows)]
    padded_row = max(wide - two - (costs.of(rows[2]) - costs.of(rows[1])), 0.0) / (padding[2] - padding[1])
    masking = max(two - plain - (costs.of(rows[1]) - costs.of(rows[0])) - padded_row * padding[1], 0.0)
    return padded_row, masking


@dataclass
class SuccessRate:
    """How often something worked in one sequence, with a Beta(1, 1) prior (1/2 before anything is seen)."""

    tries: int = 0
    successes: int = 0

    def record(self, success: bool) -> None:
        self.tries += 1
        self.successes += bool(success)

    @property
    def value(self) -> float:
        return (self.successes + 1) / (self.tries + 2)


def fusing_pays(costs: ForwardCosts | None, width: int, plan_width: int, used: SuccessRate, batch: int = 1) -> bool:
    """Whether appending the next plan's `plan_width` masks to a request of `width` tokens, in a forward of `batch`
    sequences, costs less than what the plan would cost unfused times the chance that the plan is used (the module
    docstring); always, when the costs were not measured."""
    if costs is None:
        return True
    rows, plan_rows = batch * width, batch * plan_width
    extra = costs.of(rows + plan_rows) - costs.of(rows)
    own_forward = costs.of(plan_rows)  # the batch plans in step: the plan is a forward of its own
    padding = costs.of(max(rows, plan_rows)) - costs.of(rows)  # it pads a step the others take anyway
    return extra < used.value * (own_forward + (batch - 1) * padding) / batch


def best_draft_count(available: int, acceptance: AcceptanceByDepth, costs: ForwardCosts, width: int = 1,
                     committed: float = 1.0) -> int:
    """How many of `available` drafts to verify in a forward of one sequence: the count that maximizes expected
    committed tokens per second of forward. `width`: the forward's other tokens (the next token: 1). `committed`: the
    tokens the forward is expected to commit without these drafts (the next token: 1; with a first chain beside them,
    its tokens too). A batch's steps decide with `draft_counts`."""
    best, best_rate = 0, committed / costs.of(width)
    expected, chance = committed, 1.0  # plus each draft times its chance
    for n in range(1, available + 1):
        chance *= acceptance.rate(n)
        expected += chance
        rate = expected / costs.of(width + n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def draft_counts(offers: list[tuple[int, tuple[tuple[int, float], ...]]], others: list[int],
                 costs: ForwardCosts, columns: int = 0) -> list[int]:
    """How many items of each sequence's offer one step's forward verifies: the choice with the most expected
    committed tokens per second of that forward.

    `offers`: each offering sequence's (width, items) (`sequence.DraftOffer`): the tokens its forward holds whatever
    it drafts, and what each item adds: its rows and, in expectation, its gain in committed tokens (a draft: the
    chance that it and every draft before it are accepted, from its drafter's statistics); an item is taken only
    with the items before it. `others`: the widths of the step's other sequences (prefills, plans, AR steps). Every
    sequence commits one token for certain. The forward's cost counts its real rows and its padding: every sequence
    is padded to the widest (`ForwardCosts.of_batch`), so a sequence drafting alone makes the others pay padding;
    `columns`: the cache layout the forward attends over (the decoder's `SlotCache.used`), which every row's attention
    and the mask pay for.

    The rule: merge each offer's items into blocks whose gain per row does not grow along the offer (a block is
    taken whole) and order every sequence's blocks by gain per row; for each width the forward could have, take the
    prefix of that order (of the blocks that fit in it) that maximizes (tokens + its gains) / cost; the best over
    the widths. Plain AR for every sequence unless some choice is strictly better. One sequence with one chain gets
    `best_draft_count`'s answer.

    A step that holds more than one token for some sequence whatever is drafted (a prefill beside the others' steps,
    a plan) is slow for reasons the drafts do not change: its own rate, a few tokens over a prompt's forward, would
    make any draft look worth its rows. There the drafts are valued at the batch's rate in a plain AR step instead
    (tokens / the cost of one row a sequence): a choice is taken where its gains exceed what its extra seconds give
    at that rate (gain - rate * (cost - cost without drafts), the largest such). On E5 with `--linear int4-q8` and 8
    sequences, rate-maximizing filled such steps with drafts at ~4 ms a row: a prefill step took 770-790 ms against
    AR's 570-630, and the exact mode delivered 0.81x AR's tokens/s (`benchmarks/continuous_batching.py`)."""
    widths = [width for width, _ in offers] + list(others)
    batch, base_rows, base_width = len(widths), sum(widths), max(widths, default=1)
    tokens = float(batch)
    blocks = []  # (gain per row, sequence, items, rows, gain, the sequence's width with it)
    for index, (width, items) in enumerate(offers):
        hull: list[list] = []  # [items, rows, gain] with non-increasing gain per row
        for item_rows, gain in items:
            hull.append([1, item_rows, gain])
            while len(hull) > 1 and hull[-1][2] * hull[-2][1] > hull[-2][2] * hull[-1][1]:
                count, block_rows, block_gain = hull.pop()
                hull[-1] = [hull[-1][0] + count, hull[-1][1] + block_rows, hull[-1][2] + block_gain]
        for count, block_rows, gain in hull:
            width += block_rows
            blocks.append((gain / max(block_rows, 1), index, count, block_rows, gain, width))
    blocks.sort(key=lambda b: -b[0])  # stable: an offer's blocks keep their order
    priced: dict[tuple[int, int], float] = {}  # (rows, widest) -> seconds: the widths' prefixes share many

    def cost(rows: int, widest: int) -> float:
        if (rows, widest) not in priced:
            priced[rows, widest] = costs.of_batch(rows, batch, widest, columns)
        return priced[rows, widest]

    base_cost = cost(base_rows, base_width)
    reference = tokens / cost(batch, 1) if base_width > 1 else None  # the batch's rate in a plain AR step

    def value(gain: float, rows: int, widest: int) -> float:
        if reference is None:  # the step's own rate: its tokens (one a sequence, plus the gains) per second
            return (tokens + gain) / cost(rows, widest)
        return gain - reference * (cost(rows, widest) - base_cost)  # what the drafts add beyond their time's worth

    best, best_value = [], value(0.0, base_rows, base_width)
    if reference is None and no_draft_pays(blocks, tokens, best_value, costs, base_rows, batch, columns):
        return [0] * len(offers)
    for limit in sorted({base_width, *(b[5] for b in blocks if b[5] > base_width)}):
        fitting = [b for b in blocks if b[5] <= limit]
        rows, gain, widest = base_rows, 0.0, base_width
        for taken, block in enumerate(fitting, 1):
            rows, gain, widest = rows + block[3], gain + block[4], max(widest, block[5])
            if (candidate := value(gain, rows, widest)) > best_value:
                best, best_value = fitting[:taken], candidate
    counts = [0] * len(offers)
    for _, index, count, _, _, _ in best:
        counts[index] += count
    return counts


def no_draft_pays(blocks: list[tuple], tokens: float, plain: float, costs: ForwardCosts, base_rows: int, batch: int,
                  columns: int) -> bool:
    """Whether `draft_counts`' search (at the step's own rate) can be skipped: no choice of `blocks` (sorted by
    gain per row, densest first) beats `plain` tokens per second. With R more rows a choice gains at most the R
    densest rows' gains and costs at least `ForwardCosts.least_of_batch` of its rows, so where that bound stays
    under the plain step for every R nothing is taken; the search would take nothing too, and it prices every
    width's prefixes (on E5, 8 sequences that offered drafts no step took: ~230 prices a step). A block without rows
    (a gain for free) leaves the search to decide.

    Within a block the gain grows by the same density a row, and between two measured widths the least cost grows
    linearly too, so (tokens + gain) / cost is monotone there: only each such piece's ends are checked (a block's
    first and last row and the measured widths between them), not every row."""
    if any(block[3] == 0 for block in blocks):
        return False
    rows, gain = base_rows, 0.0
    for density, _, _, block_rows, _, _ in blocks:
        last = rows + block_rows
        for end in {rows + 1, last, *(w for w in costs.widths if rows + 1 < w < last)}:
            if (tokens + gain + density * (end - rows)) / costs.least_of_batch(end, batch, columns) >= plain * (1 - 1e-9):
                return False  # some choice might pay (the margin: the search sums the same gains in another order)
        rows, gain = last, gain + density * block_rows
    return True


def drafting_may_pay(bounds: list[tuple[int, float]], others: list[int], costs: ForwardCosts,
                     columns: int = 0) -> bool:
    """Whether any draft could pay in a step, before the drafters are asked: `bounds` holds each drafting
    sequence's (rows, gain per row) (`sequence.DraftBound`: the most its offer could hold), `others` the widths of the
    step's other sequences. Where every sequence takes one token, an offer's items gain at most their bound's rate
    per row and hold at most its rows, so the R densest rows `draft_counts` could take gain at most the R densest
    bounded ones: where `no_draft_pays` holds for the bounds, it holds for every offer they bound, and the search
    would take nothing. Beside a wider request (a prefill, a plan) drafts are valued at another rate: True."""
    widths = [1] * len(bounds) + list(others)
    if max(widths, default=1) > 1:
        return True
    batch = len(widths)
    blocks = sorted(((gain, index, rows, rows, gain * rows, 1 + rows)
                     for index, (rows, gain) in enumerate(bounds) if rows), key=lambda block: -block[0])
    plain = batch / costs.of_batch(batch, batch, 1, columns)
    return not no_draft_pays(blocks, float(batch), plain, costs, batch, batch, columns)
