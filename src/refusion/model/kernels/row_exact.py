"""Row-exact bf16 forwards on CPUs with native bf16 (AMX, AVX512-BF16): every row of a forward computed as it
would be alone.

The exact mode verifies k drafted tokens in one forward and commits the tokens AR decoding would have chosen
one token at a time. That holds bit for bit only if a row of a k-token forward gets the same numbers as the
same row in a one-token forward. On the CPU, fp32 products and torch's fused attention round a row differently
by the number of rows (rarely enough to flip a greedy token in fp32, often in bf16). This module makes bf16
forwards row-exact, and fast:

* `PackedLinear`. A bf16 `F.linear` on the CPU goes through oneDNN, which reorders the weight into its blocked
  layout (AMX tiles, AVX512-BF16 registers) on every call; for the few rows of a decoding forward that
  reordering is most of the cost.
  `PackedLinear` reorders the weight once (`torch.ops.mkldnn._reorder_linear_weight`, the layout torch's own
  compiler freezes into CPU graphs). On a 2-core AMX Xeon the 210 matrices of SmolLM2-135M's layers cost
  13.5 ms per forward packed against 19.5 ms plain, for 1, 4 or 8 rows alike. Up to some number of rows (32
  there; `exact_rows` finds it for each weight shape) each output row depends on its own input row only, bit
  for bit; wider products switch to kernels that round differently, so they are computed in chunks of that
  many rows (a prefill of 100 tokens: 0.33 against 0.18 ms per matrix; decoding forwards are narrower). Where
  one-row products take a kernel of their own (an AVX512-BF16 EPYC's, for 1536 inputs), they are padded to two
  rows (`ExactRows`).
* `exact_attention` (attention implementation "refusion_exact"). bf16 attention products are not exact row by
  row either, not even in the eager implementation (a query row of a 5-row product over 180 keys differed
  from the same row alone). Here both products take their bf16 operands in fp64: a product of two bf16 numbers
  has 16 significant bits, so the sums are exact whatever their order (unless terms span more than 2^37). The
  softmax between them sums in fp32, in an order that follows where each column sits, so it runs over the columns
  a row sees moved to the front (`canonical_softmax`): neither the number of query rows nor where the keys sit in
  the cache (holes a batch's other sequences leave) changes a bit of the result. It costs ~1.5 ms per forward of
  SmolLM2-135M (30 layers).

The packed copy lives beside the parameter (training and the state dict see the plain weight) and is rebuilt
when the parameter changes (an optimizer step, `load_state_dict`, a move). It doubles the memory of the
weights, so only models up to `MAX_PACKED_BYTES` are packed.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import astuple, dataclass

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_BYTES = 2 * 2**30
"""Models whose linear weights take more than this are not packed (the packed copy doubles their memory)."""
MAX_EXACT_ROWS = 32
"""`exact_rows` looks for exact products of at most this many rows."""
EXACT_ROWS_VERSION = 1
"""Part of `exact_rows`' record key: bump when `probe_exact_rows` changes what it reports."""
MIN_EXACT_ROWS = 8
"""bf16 is the CPU default only where products of at least this many rows are exact (`packed_rows_match`)."""
ALONE_PROBE_ROWS = 128
"""`exact_rows` compares one-row and two-row products over this many rows of weights up to ALONE_PROBE_BYTES (a
one-row kernel that rounds a few outputs its own way shows on ~9 % of rows of SmolLM2-135M's down projection on
an AVX512-BF16 EPYC)."""
ALONE_PROBE_BYTES = 2**24
"""Bigger weights are compared over MAX_EXACT_ROWS rows (each one-row product streams the whole weight)."""


@dataclass(frozen=True)
class ExactRows:
    """The row counts at which packed bf16 products of one weight shape compute every row as it would be alone
    (`exact_rows`): `chunked_product` pads narrower products and splits wider ones."""

    low: int = 1
    """Products of fewer rows are padded with zero rows to this many. 2 where one-row products take a kernel of
    their own that rounds a few outputs differently from products of 2 rows or more (measured on an AVX512-BF16
    CPU without AMX), else 1."""
    high: int = 1
    """Products of more rows are computed in chunks of at most this many."""


class PackedLinear(nn.Linear):
    """nn.Linear whose bf16 CPU inference forward multiplies by a oneDNN-packed copy of its weight, at the row
    counts of `exact_rows` (`chunked_product`)."""

    exact_rows: ExactRows = ExactRows()
    """The row counts at which products compute each row as it would be alone (`exact_rows`)."""

    packed_weight: torch.Tensor | None = None
    """The oneDNN-packed copy of the weight (`_packed`)."""

    packed_key: tuple | None = None
    """(data pointer, version) of the weight `packed_weight` was packed from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the weight packed before compiling, through the opaque operator
            return self._product(x, self.packed_weight, _compiled_packed_product)
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.is_grad_enabled() or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        return self._product(x, self._packed(), packed_product)

    def _product(self, x: torch.Tensor, packed: torch.Tensor, product) -> torch.Tensor:
        out = chunked_product(x.reshape(-1, self.in_features), packed, self._parameters["bias"], self.exact_rows,
                              product)
        return out.view(*x.shape[:-1], self.out_features)

    def _packed(self) -> torch.Tensor:
        """The packed weight, rebuilt when the parameter was written or replaced since it was packed."""
        return packed_copy(self, reorder_weight)


def reorder_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a bf16 [out, in] weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_copy(layer: nn.Linear, pack) -> torch.Tensor:
    """`pack(layer.weight)`, kept on the layer (`packed_weight`, with the `packed_key` it was packed at) and rebuilt
    when the parameter was written or replaced since: the packed linear layers' weight copy."""
    weight = layer._parameters["weight"]  # (the dict itself: nn.Module's attribute lookup costs microseconds)
    key = weight_key(weight)
    if key != layer.packed_key:
        layer.packed_weight = pack(weight.detach())
        layer.packed_key = key
    return layer.packed_weight


def weight_key(weight: torch.Tensor) -> tuple:
    """(data pointer, version) of a weight: it changes when the weight is written or replaced (inference tensors
    have no version), so a kernel's copy of the weight knows when to be rebuilt or refused."""
    return weight.data_ptr(), None if weight.is_inference() else weight._version


def packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) by oneDNN's packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def chunked_product(flat: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, rows: ExactRows,
                    product=packed_product) -> torch.Tensor:
    """flat [M, K] @ W.T (+ bias) by a packed weight at the row counts where each row is computed as it would be
    alone (`ExactRows`): fewer rows than `rows.low` padded with zero rows, more than `rows.high` in chunks."""
    n = flat.shape[0]
    if rows.low <= n <= rows.high:
        return product(flat, packed_weight, bias)
    if n < rows.low:
        padded = torch.cat([flat, flat.new_zeros(rows.low - n, flat.shape[1])])
        return product(padded, packed_weight, bias)[:n]
    return torch.cat([chunked_product(chunk, packed_weight, bias, rows, product) for chunk in flat.split(rows.high)])


@torch.library.custom_op("refusion::packed_product", mutates_args=())
def _compiled_packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`packed_product` as an operator torch.compile does not look into: a compiled forward calls this very kernel
    (the compiler's own lowering of it expects weights it froze itself), so its rows stay exact. Eager forwards
    skip it (a custom operator's dispatch costs microseconds per call)."""
    return packed_product(x, packed_weight, bias)


@_compiled_packed_product.register_fake
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed_weight.shape[0])  # the packed weight is [out, in]


@functools.cache
def packing_available() -> bool:
    """Whether this CPU and torch build multiply bf16 weights packed by oneDNN with native bf16 instructions (AMX
    tiles, or AVX512-BF16 where there is no AMX; oneDNN emulates bf16 on other AVX512 CPUs, which this leaves
    out; a fact of the machine: asked once)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def speedup(baseline, candidate, repeats: int) -> float:
    """Seconds of `baseline()` over seconds of `candidate()`: each called once untimed (first calls choose their
    kernels), then both in turns `repeats` times, the fastest call of each counting (the kernel probes' timing)."""
    def seconds(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    baseline(), candidate()
    times = [(seconds(baseline), seconds(candidate)) for _ in range(repeats)]
    return min(t for t, _ in times) / max(min(t for _, t in times), 1e-9)


@functools.cache
def exact_rows(in_features: int, out_features: int, max_rows: int = MAX_EXACT_ROWS) -> ExactRows:
    """Where packed bf16 products of this weight shape compute every row as it would be alone (`probe_exact_rows`,
    run once per machine and shape and recorded with the model cache, `model.calibration`: it compares bits, so
    it gives the same answer every time, but it costs ~0.1 s a shape at every start). A recorded answer is
    checked before it is used (`parse_exact_rows`, then `spot_check` multiplies once at its row count): a stale
    or edited one would void the exactness promise silently."""
    from refusion.model import calibration

    return calibration.recorded(
        "exact_rows", {"shape": [out_features, in_features], "max_rows": max_rows, "version": EXACT_ROWS_VERSION},
        lambda: list(astuple(probe_exact_rows(in_features, out_features, max_rows))),
        parse=lambda value: parse_exact_rows(value, max_rows),
        check=lambda rows: spot_check(rows, in_features, out_features))


def parse_exact_rows(value, max_rows: int = MAX_EXACT_ROWS) -> ExactRows:
    """The `ExactRows` of a recorded [low, high]; a ValueError for anything else (low 1 or 2, low <= high <=
    max_rows)."""
    from refusion.model.calibration import require, whole

    require(isinstance(value, list) and len(value) == 2, "[low, high]")
    low = whole(value[0], 1, 2)
    return ExactRows(low, whole(value[1], low, max_rows))


@torch.no_grad()
def spot_check(rows: ExactRows, in_features: int, out_features: int) -> str | None:
    """Whether recorded row counts hold here, in one product at their `high` row count (random weights of this
    shape): its first and last rows against the same rows alone (padded to `low` rows by `chunked_product`, as
    the layers pad them). None when they match; else what differs."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    packed_weight = reorder_weight(weight)
    x = torch.randn(rows.high, in_features, generator=generator).to(torch.bfloat16)
    together = chunked_product(x, packed_weight, None, rows, packed_product)
    for i in sorted({0, rows.high - 1}):
        alone = chunked_product(x[i:i + 1], packed_weight, None, rows, packed_product)
        if not torch.equal(together[i:i + 1], alone):
            return f"row {i + 1} of a {rows.high}-row product differs from the row alone"
    return None


@torch.no_grad()
def probe_exact_rows(in_features: int, out_features: int, max_rows: int = MAX_EXACT_ROWS) -> ExactRows:
    """Where packed bf16 products of this weight shape compute every row as it would be alone (random weights
    of this shape, from a generator of its own). `low`: 1 where one-row products equal two-row products of the same rows
    (over ALONE_PROBE_ROWS rows), else 2. `high`: the largest r <= max_rows such that products of low..r rows
    give each row's product at `low` rows bit for bit (`low` when none does); 1 when a one-row packed product
    differs from `F.linear`'s."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    packed_weight = reorder_weight(weight)
    small = weight.numel() * weight.element_size() <= ALONE_PROBE_BYTES
    count = max(ALONE_PROBE_ROWS if small else 0, max_rows)
    count += count % 2  # compared in pairs
    x = torch.randn(count, in_features, generator=generator).to(torch.bfloat16)
    alone = torch.cat([packed_product(x[i:i + 1], packed_weight, None) for i in range(count)])
    if not torch.equal(alone[:1], F.linear(x[:1], weight)):
        return ExactRows(1, 1)
    pairs = torch.cat([packed_product(x[i:i + 2], packed_weight, None) for i in range(0, count, 2)])
    low, reference = (1, alone) if torch.equal(pairs, alone) else (2, pairs)
    for rows in range(low + 1, max_rows + 1):
        if not torch.equal(packed_product(x[:rows], packed_weight, None), reference[:rows]):
            return ExactRows(low, rows - 1)
    return ExactRows(low, max_rows)


def packed_rows_match() -> bool:
    """Whether packed products of at least MIN_EXACT_ROWS rows are exact row by row here (a typical shape)."""
    return exact_rows(576, 1536).high >= MIN_EXACT_ROWS


def use_packed_linears(model: nn.Module) -> int:
    """Switch the plain linear layers of a bf16 CPU model to `PackedLinear` where packing is available (see the
    module docstring), each with the exact row count of its shape. Returns how many layers were switched."""
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    if not layers or any(layer.weight.device.type != "cpu" or layer.weight.dtype != torch.bfloat16
                         for layer in layers):
        return 0
    if sum(layer.weight.numel() * 2 for layer in layers) > MAX_PACKED_BYTES or not packing_available():
        return 0
    rows = {shape: exact_rows(*shape) for shape in {(layer.in_features, layer.out_features) for layer in layers}}
    for layer in layers:
        layer.__class__ = PackedLinear
        layer.exact_rows = rows[layer.in_features, layer.out_features]
    return len(layers)


EXACT_ATTENTION = "refusion_exact"
"""The attention implementation name `exact_attention` is registered under with transformers."""
EXACT_HALF_ATTENTION = "refusion_exact_half"
"""The attention implementation name `exact_half_attention` is registered under with transformers."""
EXACT_ATTENTIONS = (EXACT_ATTENTION, EXACT_HALF_ATTENTION)
"""The row-exact attention implementations."""
ADDITIVE_MASK_ATTENTION = ("eager", *EXACT_ATTENTIONS)
"""Attention implementations that take additive float masks (sdpa takes boolean ones)."""


SOFTMAX_COLUMNS = 64
"""The fewest columns exact attention's softmax runs over (a shorter row padded): ATen sums a row of fewer columns than
its vector's lanes in another order than a longer one, so every row takes the long path (`canonical_softmax`)."""


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Eager attention whose two products sum in fp64 (see the module docstring): each query row's output is
    the same whatever the other rows and the order of the keys. query [B, H, T, D], key and value
    [B, H_kv, L, D], attention_mask additive [B, 1, T, L] or None. Attention with a logit soft cap (Gemma 2)
    falls back to the model's own eager attention."""
    if soft_capped(module, kwargs):
        return sys.modules[type(module).__module__].eager_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * rows, dim).double()  # queries sharing a key head
    scores = torch.matmul(grouped, key.double().transpose(2, 3)).view(batch, heads, rows, length).mul_(scaling)
    if attention_mask is not None:
        scores.add_(attention_mask[:, :, :, :length])
    weights = canonical_softmax(scores, attention_mask).to(query.dtype)
    if dropout and module.training:
        weights = F.dropout(weights, p=dropout)
    out = torch.matmul(weights.view(batch, kv_heads, -1, length).double(), value.double())
    out = out.view(batch, heads, rows, dim).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


def exact_half_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """`exact_attention` over keys and values rounded to fp16, as a decoder's cache keeps them under this
    attention (`cache_dtype`; llama.cpp's default KV cache): each entry a quarter of an fp64 one's bytes, widened to
    fp64 exactly where it is multiplied, so a decoding step that reads a long context reads 4x fewer bytes. The same
    row-exact sums as `exact_attention`; the answers are those of a model whose keys and values are rounded to fp16."""
    if not soft_capped(module, kwargs):  # (with a soft cap: the model's eager attention, as `exact_attention`'s)
        key, value = key.to(torch.float16), value.to(torch.float16)
    return exact_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def soft_capped(module: nn.Module, kwargs: dict) -> bool:
    """Whether attention takes a logit soft cap (Gemma 2): the exact attentions leave it to the model's eager one."""
    return bool(kwargs.get("softcap") or getattr(getattr(module, "config", None), "attn_logit_softcapping", None))


def canonical_softmax(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax in fp32 of [B, H, T, L] scores, 0 at the columns a row does not see (the mask's lowest value there),
    each row's sums the same wherever its keys sit in the cache: the seen columns are moved to the front in their
    order and followed by padding to at least SOFTMAX_COLUMNS (ATen's vectorised softmax sums a column in the lane
    its index gives it, so the holes other sequences leave between a row's keys would change its rounding)."""
    length = scores.shape[-1]
    fill = torch.finfo(torch.float32).min
    flat = scores.to(torch.float32)
    pad = (0, max(0, SOFTMAX_COLUMNS - length))
    if attention_mask is None:
        return torch.softmax(F.pad(flat, pad, value=fill), dim=-1)[..., :length]
    visible = (attention_mask[:, :, :, :length] > torch.finfo(attention_mask.dtype).min).expand_as(scores)
    order = torch.argsort((~visible).to(torch.uint8), dim=-1, stable=True)  # the seen columns first, in order
    front = torch.where(visible, flat, fill).gather(-1, order)
    weights = torch.softmax(F.pad(front, pad, value=fill), dim=-1)[..., :length]
    return torch.where(visible, torch.zeros_like(weights).scatter_(-1, order, weights), 0.0)


def cache_dtype(model) -> torch.dtype | None:
    """The dtype a decoder's KV cache keeps entries in for `model`: fp64 where its attention is `exact_attention`
    (which sums in fp64: entries kept in fp64, each bf16 value exactly, spare every layer of every forward a
    conversion of the whole context; they take 4x the memory of bf16 ones; measured in docs/archive/
    BENCHMARKS-JOURNAL.md, "Fused products, fp64 KV entries, llama.cpp again"), fp16 where it is
    `exact_half_attention` (the entries it rounds to), else None (the dtype the layers write)."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    if attention not in EXACT_ATTENTIONS:
        return None
    if getattr(config.get_text_config(), "attn_logit_softcapping", None):  # its own eager attention: no fp64
        return None
    return torch.float16 if attention == EXACT_HALF_ATTENTION else torch.float64


def register_with_transformers() -> None:
    """Register `exact_attention` and `exact_half_attention` with transformers under EXACT_ATTENTION and
    EXACT_HALF_ATTENTION (with additive masks, as eager attention takes them), so that its models load and run with
    `attn_implementation="refusion_exact"` (or "refusion_exact_half"). Idempotent. Called by
    the code that builds transformers models (`model.loading`, `model.tiny`) and at this module's import when
    transformers is loaded already; refusion's own model definition (`model.definition`) needs none of it, so a
    cold start through it never imports transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    for name, function in ((EXACT_ATTENTION, exact_attention), (EXACT_HALF_ATTENTION, exact_half_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, eager_mask)


if "transformers" in sys.modules:
    register_with_transformers()
