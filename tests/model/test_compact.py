"""`model.compact.CompactForward`: transformers' logits bit for bit, without its per-layer Python."""

from __future__ import annotations

import pytest
import torch

import refusion
from refusion.decode.cache import PADDING, SlotCache, attention_mask_dtype, attention_windows, cache_keyword
from refusion.model.attention_split import splits_attention
from refusion.model.compact import CompactForward, Ragged, compact_forward
from refusion.model.kernels import narrow
from refusion.model.kernels.row_exact import EXACT_ATTENTION, packing_available, use_packed_linears
from refusion.model.setup import setup_of
from refusion.model.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "qwen2", "mistral"]


def new_cache(model, kv_dtype: torch.dtype | None = None) -> SlotCache:
    config = model.config
    return SlotCache(config.num_hidden_layers, "cpu", 64, attention_mask_dtype(model), attention_windows(config),
                     kv_dtype=kv_dtype)


STEPS = [(torch.tensor([[5, 9, 11, 4, 7], [0, 0, 3, 8, 6]]), torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]),
          torch.tensor([[0] * 5, [PADDING, PADDING, 0, 0, 0]])),
         (torch.tensor([[12, 13, 63], [14, 63, 63]]), torch.tensor([[5, 6, 7], [3, 4, 5]]),
          torch.tensor([[0, 0, 1], [0, 1, 1]]))]
"""(ids, positions, groups) of two rows' forwards: a prompt beside a shorter one (padded), then three new tokens
per row, whose last group reads only itself (a mask other than the causal one)."""


def two_rows(model, kv_dtype: torch.dtype | None) -> SlotCache:
    cache = new_cache(model, kv_dtype)
    for row in range(2):
        cache.add_sequence(row)
    return cache


def forwards(model, run, kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Logits of the STEPS forwards, each through `run(ids, positions, mask, cache, keep)`; the cache keeps entries in
    `kv_dtype` (None: the layers' dtype)."""
    cache, out = two_rows(model, kv_dtype), []
    for ids, positions, groups in STEPS:
        mask = cache.begin_forward(groups, positions)
        with torch.inference_mode():
            out.append(run(ids, positions, mask, cache, ids.shape[1]))
        cache.end_forward()
    return out


def real_rows(model, run, ragged: bool, kv_dtype: torch.dtype | None = None, split: bool = False) -> list[torch.Tensor]:
    """The logits of every real token of the STEPS forwards and a third, padded one (a token and a mask beside one
    token), each forward run padded or (`ragged`) over its real rows alone (`Ragged`; `split`: attention row by row
    too): one [tokens, V] tensor per row and forward."""
    cache, out = two_rows(model, kv_dtype), []
    third = (torch.tensor([[21, 63], [0, 22]]), torch.tensor([[8, 9], [0, 6]]), torch.tensor([[2, 3], [PADDING, 2]]))
    for ids, positions, groups in [*STEPS, third]:
        counts = (groups != PADDING).sum(1).tolist()
        width = ids.shape[1]
        mask = cache.begin_forward(groups, positions, counts=counts)
        with torch.inference_mode():
            if ragged and sum(counts) < ids.numel():
                layout = Ragged.of(counts, counts, width, "cpu", split)
                out += run(ids, positions, mask, cache, width, layout)[0].split(counts)
            else:
                logits = run(ids, positions, mask, cache, width)
                out += [logits[b, width - n:] for b, n in enumerate(counts)]
        cache.end_forward()
    return out


def test_the_ragged_layout_of_a_left_padded_forward():
    layout = Ragged.of([3, 1, 2], [2, 1, 2], 3, "cpu")
    assert layout.real.tolist() == [0, 1, 2, 5, 7, 8]  # row b's tokens end at (b + 1) * width
    assert layout.keep.tolist() == [1, 2, 3, 4, 5]  # the last needs[b] of each row's real tokens
    padded = torch.arange(9.0).view(3, 3, 1)
    assert layout.gather(padded).flatten().tolist() == [0, 1, 2, 5, 7, 8]
    assert layout.scatter(layout.gather(padded)).flatten().tolist() == [0, 1, 2, 0, 0, 5, 0, 7, 8]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_batch_computes_its_real_rows_alone(family):
    """Run over its real rows alone (products, norms and MLPs; attention over the padded layout), a padded forward
    gives every real token its logits: bit for bit where every row is computed as alone (row-exact bf16), to
    rounding in fp32 (products of other row counts)."""
    fp32 = tiny_model(family, seed=3, attn_implementation="sdpa")
    for ours, theirs in zip(real_rows(fp32, CompactForward(fp32, native=False), True),
                            real_rows(fp32, CompactForward(fp32, native=False), False), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    if not packing_available():
        return
    exact = tiny_model(family, dtype=torch.bfloat16, seed=3, attn_implementation=EXACT_ATTENTION)
    use_packed_linears(exact)
    kv_dtype = torch.float64
    for ours, theirs in zip(real_rows(exact, CompactForward(exact, native=False), True, kv_dtype),
                            real_rows(exact, CompactForward(exact, native=False), False, kv_dtype), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_row_by_row_gives_each_real_row_its_attention(family, native):
    """sdpa run row by row over each row's real queries (`Ragged.split`) gives the logits of the padded call, to
    fp32 rounding (sdpa's blocks follow a call's query count), in the Python layers and the C++ ones alike."""
    from refusion.model.kernels.extension import native_available

    if native and not native_available():
        pytest.skip("the native layers are not built here")
    model = tiny_model(family, seed=3, attn_implementation="sdpa")
    run = CompactForward(model, native=native)
    assert (run.native is not None) == native
    split = real_rows(model, run, True, split=True)
    padded = real_rows(model, CompactForward(model, native=False), False)
    for ours, theirs in zip(split, padded, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_attention_splits_where_padded_queries_cost_more_than_the_extra_calls():
    """The rule the decoding forward follows (`splits_attention`), on shapes alone: a prefill joining one-token steps
    over a long cache splits; a batch of one-token steps, or a little padding over a short cache, does not."""
    assert splits_attention(4, 146, 143, 1500)  # a 143-token prefill beside three one-token steps
    assert splits_attention(4, 30, 17, 300)  # drafts of 16, 2, 8 and none
    assert not splits_attention(4, 4, 1, 5000)  # nothing padded
    assert not splits_attention(1, 143, 143, 1500)  # one row
    assert not splits_attention(3, 8, 3, 40)  # one padded query over 40 columns: not worth two calls


def test_the_decoding_forward_splits_attention_by_the_rule(monkeypatch):
    """`CachedForward` hands the compact forward a split layout exactly where `splits_attention` says so, and the
    batch decodes to the same tokens either way (fp32, a tiny model)."""
    from refusion.decode import forward as forward_module

    model = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, seed=2, attn_implementation="sdpa")
    cfg = refusion.DecodeConfig(strategy="autoregressive", max_new_tokens=6, eos_token_id=[])
    prompts = [[5, 9, 11, 4, 7, 8, 2, 6, 3, 10, 12, 13], [14], [15, 16]]
    seen = []
    original = forward_module.Ragged.of

    def recording(counts, needs, width, device, split=False):
        seen.append((list(counts), width, split))
        return original(counts, needs, width, device, split)

    monkeypatch.setattr(forward_module.Ragged, "of", staticmethod(recording))
    unsplit = refusion.generate(model, prompts, cfg).sequences
    assert seen and not any(split for *_, split in seen)  # 21 padded queries over 12 columns
    seen.clear()
    monkeypatch.setattr(forward_module, "splits_attention", lambda batch, rows, width, columns: True)
    assert refusion.generate(model, prompts, cfg).sequences == unsplit
    assert seen and all(split for *_, split in seen)


def test_a_model_refusion_did_not_prepare_builds_its_forward_once(monkeypatch):
    """Decoders of an unprepared model share its compact forward (its fused weights stacked and packed once), until
    a linear layer is switched to another kernel or replaced."""
    built = []
    init = CompactForward.__init__
    monkeypatch.setattr(CompactForward, "__init__", lambda self, *a, **k: built.append(self) or init(self, *a, **k))
    model = tiny_model("llama", hidden_size=128, heads=4, kv_heads=2, seed=2, attn_implementation="sdpa")
    cfg = refusion.DecodeConfig(strategy="autoregressive", max_new_tokens=4, eos_token_id=[])
    first = refusion.generate(model, [[5, 9, 11]], cfg).sequences
    assert refusion.generate(model, [[5, 9, 11]], cfg).sequences == first
    assert len(built) == 1 and compact_forward(model) is built[0] and built[0].fused[0] == {}
    narrow.use_narrow_linears(model, force=True, packed_from=3)  # the layers switch kernel: q/k/v and gate/up fuse
    assert refusion.generate(model, [[5, 9, 11]], cfg).sequences == first
    assert len(built) == 2 and set(built[1].fused[0]) == {"self_attn", "mlp"}
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(256, 128, bias=False)  # a replaced layer
    assert compact_forward(model) is not built[1]


def transformers_run(model):
    keyword = cache_keyword(model)

    def run(ids, positions, mask, cache, keep):
        return model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                     logits_to_keep=keep, **{keyword: cache.hf}).logits
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_compact_logits_are_transformers_bit_for_bit(family, dtype):
    model = tiny_model(family, dtype=dtype, seed=3)
    compact = compact_forward(model)
    assert isinstance(compact, CompactForward)
    for ours, theirs in zip(forwards(model, compact), forwards(model, transformers_run(model)), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("attention", ["eager", EXACT_ATTENTION])
def test_compact_runs_the_models_attention_function_and_kernels(attention):
    model = tiny_model("llama", dtype=torch.bfloat16, seed=4, attn_implementation=attention)
    if packing_available():
        use_packed_linears(model)
    for ours, theirs in zip(forwards(model, compact_forward(model)), forwards(model, transformers_run(model))):
        assert torch.equal(ours, theirs)


def test_sliding_window_layers_get_their_own_masks():
    model = tiny_model("qwen2", seed=5, sliding_window=3, use_sliding_window=True, max_window_layers=1)
    for ours, theirs in zip(forwards(model, compact_forward(model)), forwards(model, transformers_run(model))):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("strategy", ["refusion", "speculative", "autoregressive"])
def test_decoding_with_and_without_it_gives_the_same_tokens_and_forwards(strategy):
    model = tiny_model("llama", dtype=torch.bfloat16, seed=6)
    cfg = refusion.DecodeConfig(strategy="refusion", max_new_tokens=24, slot_size=4, block_size=8,
                                slot_threshold=0.5, token_threshold=0.3).for_strategy(strategy)
    prompts = [[5, 9, 11], [7, 3, 8, 12, 40, 41], [22]]
    setup = setup_of(model)
    compact = refusion.generate(model, prompts, cfg, setup=setup)
    plain = refusion.generate(model, prompts, cfg, setup=setup.replace(compact=False))
    assert compact.sequences == plain.sequences
    assert compact.stats.batch.forwards == plain.stats.batch.forwards


def test_models_it_cannot_run_decode_through_transformers():
    hooked = tiny_model("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out)  # e.g. offloading, tracing
    assert compact_forward(hooked) is None
    training = tiny_model("qwen3").train()
    assert compact_forward(training) is None
    other = tiny_model("qwen3")
    other.config.model_type = "gemma"  # a family it does not know
    assert compact_forward(other) is None
    hooks_it_runs = tiny_model("llama")  # the embedding's and the LM head's hooks run: they are module calls
    calls = []
    hooks_it_runs.lm_head.register_forward_hook(lambda module, args, out: calls.append(1))
    assert compact_forward(hooks_it_runs) is not None
    refusion.generate(hooks_it_runs, [[5, 6]], refusion.DecodeConfig(strategy="autoregressive", max_new_tokens=3,
                                                                       eos_token_id=[]))
    assert len(calls) == 3
