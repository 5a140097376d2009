"""`model.kernels.native`: the compact forward's layer loop in C++ gives the Python loop's logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import refusion
from refusion.decode.cache import PADDING, SlotCache, attention_mask_dtype
from refusion.model.compact import CompactForward, Ragged, compact_forward
from refusion.model.kernels import extension, fused, gated_lora, row_exact
from refusion.model.setup import setup_of
from refusion.model.tiny import tiny_model

from .test_compact import FAMILIES, forwards, new_cache, real_rows
from .test_fused import KINDS, gate_adapters, model_with

ATTENTIONS = [row_exact.EXACT_ATTENTION, "sdpa", row_exact.EXACT_HALF_ATTENTION]


def exact_model(family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                attention: str = row_exact.EXACT_ATTENTION, **overrides):
    return tiny_model(family, hidden_size=64, dtype=dtype, seed=seed, attn_implementation=attention, **overrides)


def python_run(model) -> CompactForward:
    return CompactForward(model, native=False)


def native_run(model) -> CompactForward:
    """The model's compact forward, asserting that every forward of it runs the C++ layers."""
    compact = compact_forward(model)
    assert compact.native is not None
    run = compact.native.__call__

    def checked(*args):
        out = run(*args)
        assert out is not None, "the forward ran the Python loop"
        return out
    compact.native = type("Checked", (), {"__call__": staticmethod(checked)})()
    return compact


def fp64_forwards(model, run) -> list[torch.Tensor]:
    """`forwards` over a cache that keeps the entries decoders keep under the model's attention (fp64 under exact
    attention, fp16 under exact attention over fp16 entries)."""
    return forwards(model, run, kv_dtype=row_exact.cache_dtype(model))


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_the_extension_builds_here():
    assert extension.native_extension() is not None  # gcc, the Python headers and ninja are on every such machine


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_layers_give_the_python_loops_logits_bit_for_bit(family, dtype, attention):
    # plain products; Qwen2 with q/k/v biases, Qwen3 with q/k norms; forwards() has masks, padding and one token
    model = exact_model(family, dtype, seed=1, attention=attention)
    assert_same(forwards(model, native_run(model)), forwards(model, python_run(model)))
    assert_same(fp64_forwards(model, native_run(model)), fp64_forwards(model, python_run(model)))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_one_token_forwards_without_a_mask(attention):
    """The AR step over a hole-free context: no mask at all (sdpa then groups the query heads by KV head)."""
    model = exact_model("llama", torch.float32, seed=6, attention=attention)
    outs = []
    for run in (native_run(model), python_run(model)):
        cache = SlotCache(model.config.num_hidden_layers, "cpu", 16, attention_mask_dtype(model))
        cache.add_sequence(0)
        logits = []
        for step, ids in enumerate(([5, 9, 11], [4], [7])):
            start = cache.used
            positions = torch.arange(start, start + len(ids))[None]
            groups = torch.zeros_like(positions)
            mask = cache.begin_forward(groups, positions)
            assert (mask is None) == (step > 0)
            with torch.inference_mode():
                logits.append(run(torch.tensor([ids]), positions, mask, cache, len(ids)))
            cache.end_forward()
            cache.commit(0, positions[0])
        outs.append(logits)
    assert_same(*outs)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,attention", [(torch.bfloat16, row_exact.EXACT_ATTENTION), (torch.float32, "sdpa"),
                                             (torch.float32, row_exact.EXACT_HALF_ATTENTION)])
def test_long_forwards_at_the_embedded_models_head_size(family, dtype, attention):
    """A 150-token prompt beside a padded 90-token one, then a 6-token forward with a mask of its own and a
    one-token step, at head dim 64 with three query heads per KV head (the embedded model's attention): the
    fused kernels' vectorised and parallel loops, and the prompt's columns a row does not see yet, give the
    Python loop's logits bit for bit."""
    model = tiny_model(family, hidden_size=192, heads=3, kv_heads=1, dtype=dtype, seed=8,
                       attn_implementation=attention)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    ids = torch.randint(3, 60, (2, 150), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.arange(150), (torch.arange(150) - 60).clamp(min=0)])
    groups = torch.stack([torch.zeros(150, dtype=torch.long), torch.where(torch.arange(150) < 60, PADDING, 0)])
    steps = [(ids, positions, groups),
             (torch.tensor([[5, 9, 11, 4, 7, 8], [6, 63, 63, 63, 12, 13]]), torch.tensor([[150 + i for i in range(6)],
              [90 + i for i in range(6)]]), torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])),
             (torch.tensor([[21], [22]]), torch.tensor([[156], [96]]), torch.tensor([[0], [0]]))]
    assert_same(two_row_steps(model, native_run(model), steps, 64),
                two_row_steps(model, python_run(model), steps, 64))


def two_row_steps(model, run, steps, capacity: int, ragged: bool = False) -> list[torch.Tensor]:
    """The logits of `steps` ((ids, positions, groups) of two rows each) through `run` over one cache; `ragged`:
    each forward over its real rows alone (`compact.Ragged`), its tokens committed after it."""
    cache = SlotCache(model.config.num_hidden_layers, "cpu", capacity, attention_mask_dtype(model),
                      kv_dtype=row_exact.cache_dtype(model))
    for row in range(2):
        cache.add_sequence(row)
    logits = []
    with torch.inference_mode():  # the cache moves entries made under it
        for ids, positions, groups in steps:
            width = ids.shape[1]
            if not ragged:
                mask = cache.begin_forward(groups, positions)
                logits.append(run(ids, positions, mask, cache, width))
                cache.end_forward()
                continue
            counts = (groups != PADDING).sum(1).tolist()
            mask = cache.begin_forward(groups, positions, counts=counts)
            logits += run(ids, positions, mask, cache, width, Ragged.of(counts, counts, width, "cpu"))[0].split(counts)
            cache.end_forward()
            for row, n in enumerate(counts):
                cache.commit(row, positions[row, width - n:])
    return logits


@pytest.mark.parametrize("attention", [row_exact.EXACT_ATTENTION, row_exact.EXACT_HALF_ATTENTION])
def test_exact_attention_over_the_real_rows_of_a_wide_padded_forward(attention):
    """A 70-token prompt beside a one-token one (69 padding rows), then a 3-token step beside a one-token step, each
    forward over its real rows alone (`compact.Ragged`): exact attention computes those rows only, 64 at a time, and
    gives the logits of the Python loop (which computes the whole padded layout) bit for bit."""
    model = tiny_model("llama", hidden_size=192, heads=3, kv_heads=1, dtype=torch.float32, seed=9,
                       attn_implementation=attention)
    prompt = torch.randint(3, 60, (70,), generator=torch.Generator().manual_seed(1))
    padding = torch.full((69,), PADDING)
    steps = [(torch.stack([prompt, torch.cat([torch.zeros(69, dtype=torch.long), prompt[:1]])]),
              torch.stack([torch.arange(70), torch.zeros(70, dtype=torch.long)]),
              torch.stack([torch.zeros(70, dtype=torch.long), torch.cat([padding, torch.zeros(1, dtype=torch.long)])])),
             (torch.tensor([[21, 22, 23], [0, 0, 24]]), torch.tensor([[70, 71, 72], [0, 0, 1]]),
              torch.tensor([[0, 0, 0], [PADDING, PADDING, 0]]))]
    assert_same(two_row_steps(model, native_run(model), steps, 160, ragged=True),
                two_row_steps(model, python_run(model), steps, 160, ragged=True))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_products_unfused_and_fused(family):
    if not row_exact.packing_available():
        pytest.skip("this CPU's torch packs no bf16 weights")
    model = exact_model(family, seed=2)
    row_exact.use_packed_linears(model)
    for fuse in (True, False):
        compact = native_run(model) if fuse else CompactForward(model, fuse=False)
        assert compact.native is not None
        assert_same(fp64_forwards(model, compact), fp64_forwards(model, python_run(model)))


def test_packed_products_padded_and_chunked_as_the_python_layers_do(monkeypatch):
    """Products at 2..3 rows (narrower ones padded, wider ones chunked) over an MLP of 1536 features (whose
    one-row products an AVX512-BF16 EPYC rounds its own way): the C++ layers compute what the Python loop does."""
    if not row_exact.packing_available():
        pytest.skip("this CPU's torch packs no bf16 weights")
    rows = row_exact.ExactRows(2, 3)
    monkeypatch.setattr(fused, "exact_rows", lambda *shape: rows)
    model = tiny_model("llama", hidden_size=256, dtype=torch.bfloat16, seed=6, intermediate_size=1536,
                       attn_implementation=row_exact.EXACT_ATTENTION)
    row_exact.use_packed_linears(model)
    for layer in model.modules():
        if isinstance(layer, row_exact.PackedLinear):
            layer.exact_rows = rows
    for fuse in (True, False):
        compact = native_run(model) if fuse else CompactForward(model, fuse=False)
        assert compact.native is not None
        assert_same(fp64_forwards(model, compact), fp64_forwards(model, python_run(model)))
        assert_same(one_token_steps(model, compact), one_token_steps(model, python_run(model)))


def one_token_steps(model, run, steps: int = 64) -> list[torch.Tensor]:
    """Logits of a prompt forward, then of `steps` one-token forwards (one-row products), over fp64 entries."""
    cache = new_cache(model, row_exact.cache_dtype(model))
    cache.add_sequence(0)
    ids, out = torch.tensor([[5, 9, 11, 4, 7]]), []
    with torch.inference_mode():
        for step in range(steps):
            positions = torch.arange(ids.shape[1]).unsqueeze(0) + (0 if step == 0 else 4 + step)
            mask = cache.begin_forward(torch.zeros_like(ids), positions)
            out.append(run(ids, positions, mask, cache, 1))
            cache.end_forward()
            ids = torch.tensor([[(7 * step + 3) % 60]])
    return out


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_mask_gated_updates_land_where_the_python_loop_puts_them(kind, gated, kernel, monkeypatch):
    """By the extension's loops (`gated_lora.mask_update`) or by ATen's products, as the Python loop computes them."""
    model = model_with(kind, "qwen2", seed=3)  # fused products with a bias, updates on q/k/v and gate/up
    gate_adapters(model).kernel = kernel
    if not gated:  # the listed-rows path (wide forwards) instead of every row times the gate
        monkeypatch.setattr(gated_lora, "MAX_ROWS", 0)
    assert_same(fp64_forwards(model, native_run(model)), fp64_forwards(model, python_run(model)))


def update_inputs(rows: int, in_features: int, rank: int, cols: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    a = torch.randn(in_features, rank, generator=generator)
    b = torch.randn(rank, cols, generator=generator)
    out = torch.randn(rows, cols, generator=generator).to(dtype)
    return x, a, b, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 16, 96), (37, 6, 20), (64, 33, 7)])  # ranks by 16, 4 and 1 columns
def test_mask_update_adds_the_low_rank_product_at_the_listed_rows_only(shape, dtype):
    in_features, rank, cols = shape
    x, a, b, out = update_inputs(9, in_features, rank, cols, dtype)
    rows = torch.tensor([1, 4, 8])
    before = out.clone()
    with torch.inference_mode():
        assert gated_lora.mask_update(x, rows, a, b, out)
    exact = before[rows].double() + x[rows].double() @ a.double() @ b.double()
    scale = (x[rows].double().abs() @ a.double().abs() @ b.double().abs()).max()
    tolerance = 1e-5 * scale if dtype == torch.float32 else 1e-2 * scale  # fp32 sums; bf16 output rounding
    assert (out[rows].double() - exact).abs().max() <= tolerance
    others = [r for r in range(9) if r not in rows.tolist()]
    assert torch.equal(out[others], before[others])


@pytest.mark.parametrize("threads", [1, 2])
def test_mask_update_gives_a_row_the_same_bits_alone_or_with_others(threads, monkeypatch):
    """A row's update depends on that row alone, whatever else is listed (unlike a GEMM's blocking) and however
    many threads share the rows."""
    x, a, b, out = update_inputs(12, 96, 16, 40, torch.bfloat16, seed=1)
    together, alone = out.clone(), out.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            gated_lora.mask_update(x, torch.arange(12), a, b, together)  # 12 rows: apart on the threads
            gated_lora.mask_update(x, torch.tensor([5]), a, b, alone)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone[5], together[5])


def test_mask_update_leaves_autograd_and_other_layouts_to_aten():
    x, a, b, out = update_inputs(4, 32, 4, 8, torch.float32)
    rows = torch.tensor([0, 2])
    assert not gated_lora.mask_update(x, rows, a, b, out)  # autograd on: ATen's products, which it records
    with torch.inference_mode():
        assert not gated_lora.mask_update(x.t().contiguous().t(), rows, a, b, out)  # columns not contiguous
        assert not gated_lora.mask_update(x.half(), rows, a, b, out)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("kind", [*KINDS, "plain"])
def test_padded_forwards_of_real_rows_alone_give_the_python_loops_bits(kind, gated, monkeypatch):
    """A padded forward run over its real rows alone (`compact.Ragged`: the C++ layers scatter q/k/v into the
    padded layout for attention and gather its output back), with mask-gated updates at the masks among them."""
    model = (exact_model("qwen3", seed=4) if kind == "plain"  # q/k norms: the unfused path of q and k
             else model_with(kind, "qwen2", seed=3))
    gate_adapters(model)
    if not gated:
        monkeypatch.setattr(gated_lora, "MAX_ROWS", 0)
    kv_dtype = row_exact.cache_dtype(model)
    ours = real_rows(model, native_run(model), True, kv_dtype)
    assert_same(ours, real_rows(model, python_run(model), True, kv_dtype))
    if kind in ("packed", "int4", "int4-fp32", "int4-q8"):  # every row computed as alone: as the padded forward computes them
        assert_same(ours, real_rows(model, python_run(model), False, kv_dtype))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_sliding_window_layers_get_their_own_masks(attention):
    model = exact_model("qwen2", seed=4, attention=attention, sliding_window=3, use_sliding_window=True,
                        max_window_layers=1)
    assert_same(forwards(model, native_run(model)), forwards(model, python_run(model)))


@pytest.mark.parametrize("kind", KINDS)
def test_native_layers_follow_written_and_replaced_weights(kind):
    model = model_with(kind, "qwen2", seed=5)  # q/k/v with biases
    compact = native_run(model)
    forwards(model, compact)  # the stack is built
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.bias.add_(1.0)  # a bias written in place (stacked in a copy)
    assert_same(forwards(model, compact), forwards(model, python_run(model)))
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q_proj.weight.mul_(-1)  # written in place
    if kind.startswith("int4"):  # the 4-bit blocks no longer describe it: refused, as the Python loop refuses it
        with pytest.raises(RuntimeError, match="load the model again"):
            forwards(model, compact)
        return
    assert_same(forwards(model, compact), forwards(model, python_run(model)))
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight = nn.Parameter(norm.weight.detach() * 2)  # replaced by another tensor
    assert_same(forwards(model, compact), forwards(model, python_run(model)))


class Negated(nn.Linear):
    """A linear layer of a kind the C++ layers do not compute."""

    def forward(self, x):
        return -super().forward(x)


@pytest.mark.parametrize("fuse", [True, False])
def test_a_layer_switched_to_another_kernel_is_computed_by_its_new_kernel(fuse):
    model = exact_model("llama", torch.float32, seed=7)
    compact = CompactForward(model, fuse=fuse)
    forwards(model, compact)  # the stack is built with plain products
    model.model.layers[1].mlp.down_proj.__class__ = Negated
    assert_same(forwards(model, compact), forwards(model, CompactForward(model, fuse=fuse, native=False)))
    model.model.layers[1].mlp.down_proj.__class__ = nn.Linear  # and back
    assert_same(forwards(model, native_run(model)), forwards(model, python_run(model)))


def test_the_python_loop_runs_where_the_native_layers_do_not_apply():
    eager = tiny_model("llama", dtype=torch.bfloat16, attn_implementation="eager")
    assert compact_forward(eager).native is None  # another attention implementation
    assert CompactForward(exact_model("llama").to("meta")).native is None  # not on the CPU (a GPU, say)
    model = exact_model("llama")
    compact = compact_forward(model)
    cache = SlotCache(model.config.num_hidden_layers, "cpu", 16, attention_mask_dtype(model))
    cache.add_sequence(0)
    hidden = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    embeddings = compact.rotary(hidden, torch.zeros(1, 1, dtype=torch.long))
    with torch.enable_grad():  # training: autograd needs the Python operations
        assert compact.native(hidden, embeddings, [None] * 2, cache) is None


def test_loading_the_extension_again_reuses_its_build():
    """torch's loader extends the flag lists it is given: were they the module's own, a second load in the same
    process (a cleared cache, a test) would see other flags, rename the extension and compile it again (~30 s),
    and the next process would compile once more."""
    assert extension.native_extension() is not None
    flags = (list(extension.CFLAGS), list(extension.OPENMP))
    extension.native_extension.cache_clear()
    again = extension.native_extension()
    assert again is not None and again.__name__ == extension.EXTENSION
    assert flags == (extension.CFLAGS, extension.OPENMP)


def test_refusion_native_0_skips_the_extension_and_a_failed_build_warns(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    assert (Path(cpp_extension._get_build_directory(extension.EXTENSION, verbose=False)) / extension.build_tag()
            == extension.build_directory())  # where an earlier build is imported from without torch's loader
    extension.native_extension.cache_clear()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there
    try:
        monkeypatch.setenv(extension.NATIVE_ENV, "0")
        assert extension.native_extension() is None
        assert compact_forward(exact_model("llama")).native is None
        extension.native_extension.cache_clear()
        monkeypatch.delenv(extension.NATIVE_ENV)

        def broken(*args, **kwargs):
            raise RuntimeError("Error building extension 'refusion_native'\nmore lines")
        monkeypatch.setattr(cpp_extension, "load", broken)
        with pytest.warns(UserWarning, match="could not be built .Error building extension"):
            assert extension.native_extension() is None
    finally:
        extension.native_extension.cache_clear()


@pytest.mark.parametrize("dtype,attention", [("bfloat16", row_exact.EXACT_ATTENTION), ("float32", "sdpa")])
@pytest.mark.parametrize("strategy", ["autoregressive", "speculative", "refusion"])
def test_decoders_decode_the_same_tokens_and_forwards_either_way(tiny_model_dir, strategy, dtype, attention):
    model, tokenizer = refusion.load(tiny_model_dir, dtype=dtype, device="cpu", attn_implementation=attention)
    setup = setup_of(model)
    assert setup.compact_forward.native is not None
    python = setup.replace(compact_forward=python_run(model))
    prompts = [[5, 9, 11, 4, 7, 20], [3, 8, 6]]
    slots = dict(slot_size=4, block_size=8, slot_threshold=0.5, token_threshold=0.3) if strategy == "refusion" else {}
    cfg = refusion.DecodeConfig(strategy=strategy, max_new_tokens=24, eos_token_id=[2], **slots)
    ours = refusion.generate(model, prompts, cfg, setup=setup)
    theirs = refusion.generate(model, prompts, cfg, setup=python)
    assert ours.sequences == theirs.sequences
    assert [s.forwards for s in ours.stats.per_sequence] == [s.forwards for s in theirs.stats.per_sequence]


def test_weight_major_products_padded_as_the_python_layers_do():
    """fp32 layers multiplying weight-major (`model.kernels.narrow`, what a CPU without native bf16 may choose), their
    products of 1-3 rows padded to 2-4, wider ones through F.linear: the C++ layers compute what the Python loop
    does, for forwards of many rows and one-token steps."""
    from refusion.model.kernels.narrow import NarrowLinear, use_narrow_linears

    model = exact_model("llama", torch.float32, seed=9, attention="sdpa")
    assert use_narrow_linears(model, force=True, padded_rows=(0, 2, 4, 4)) > 0
    assert any(isinstance(m, NarrowLinear) for m in model.modules())
    compact = native_run(model)
    assert_same(forwards(model, compact), forwards(model, python_run(model)))
    assert_same(one_token_steps(model, compact, steps=8), one_token_steps(model, python_run(model), steps=8))


def test_a_stopped_builds_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """A build stopped by Ctrl-C leaves torch's lock file behind, and torch waits on it forever."""
    import os
    import time

    from refusion.model.kernels.extension import STALE_LOCK_SECONDS, remove_stale_lock

    lock = tmp_path / "lock"
    assert not remove_stale_lock(lock)  # none there
    lock.touch()
    assert not remove_stale_lock(lock) and lock.exists()  # a build in progress
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert remove_stale_lock(lock) and not lock.exists()
    assert "removed a build lock" in capsys.readouterr().err
