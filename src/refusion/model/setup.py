"""What refusion adds to a model, in one explicit object: `ModelSetup`.

A transformers model knows nothing of masks, draft tables or row-exact kernels. refusion keeps everything it adds
in one frozen `ModelSetup` (special tokens, draft table, the kernels chosen and why, the adapter's gate, the
exactness promise), built in one place (`prepare`, which `refusion.load` calls), attached to the model as one
attribute (the way transformers attaches its `generation_config`) and passed explicitly to `Decoder` / `generate`
(`setup=`), which otherwise read it with `setup_of(model)`.

A model refusion did not prepare (loaded with plain transformers, built in a test) gets `plain_setup(model)`: its
special tokens resolved from its configs, no draft table, its kernels as they are, and a promise that says what
they give. Decoding such a model in the exact mode where `prepare` would have made it row-exact warns once
(`check_promise`), so nothing is lost silently; `refusion.prepare(model, tokenizer)` gives it the same setup
`refusion.load` would.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from refusion.model.draft_table import TABLE_FILE, DraftTable
from refusion.model.kernels.registry import check_linear, linear_kernel_of
from refusion.model.special_tokens import SpecialTokens, resolve_special_tokens

if TYPE_CHECKING:
    import torch

    from refusion.model.calibration import ForwardCosts
    from refusion.model.compact import CompactForward

_ATTRIBUTE = "refusion_setup"
_log = logging.getLogger("refusion")


class Unprepared(UserWarning):
    """`generate` was given a model refusion did not prepare: it decodes as built, slower (no kernels chosen, no draft
    table)."""


class WeakerPromise(Unprepared):
    """A model refusion did not prepare decodes in the exact mode with rows that may round differently from AR's."""


_warned: weakref.WeakSet = weakref.WeakSet()  # models whose weaker promise was already reported


@dataclass(frozen=True)
class Kernels:
    """The kernels a model's forward runs, and why they were chosen."""

    linear: str
    """The linear kernel's name in the registry (`model.kernels.registry.LINEAR_KERNELS`: "plain", "packed",
    "narrow", "sgemm", "int4" or "int4-q8")."""

    attention: str
    """The attention implementation the model runs ("sdpa", "eager", "refusion_exact", ...)."""

    reason: str
    """Why: the CPU's features, the probes' recorded decision, that the caller pinned it, or that refusion did not
    prepare the model."""

    dtype: str = ""
    """The dtype of the model's weights ("bfloat16", "float32", ...: the numbers the kernels compute in)."""


@dataclass(frozen=True)
class ModelSetup:
    """Everything refusion adds to a model, explicit and immutable (`prepare` builds it, `setup_of` reads it)."""

    special_tokens: SpecialTokens
    """Mask, EOS and pad ids, resolved once from the model's configs and its tokenizer."""

    kernels: Kernels
    """The linear and attention kernels of the model's forward and why they were chosen."""

    draft_table: DraftTable | None = None
    """The exact mode's n-gram drafts (`DecodeConfig.table_length`), found beside the model; None when none ships."""

    preset: str | None = None
    """The decoding preset made for this model (a `refusion.config.PRESETS` name: "refusion-smol" for the embedded
    model, `model.embedded.preset_for`), which `generate` decodes with when given no config; None: the
    `DecodeConfig` defaults."""

    adapter_gate: str = "none"
    """"mask" when a mask-gated adapter is attached (it acts only at `<|mask|>` rows, so clean-token logits are
    the base's own), else "none"."""

    row_exact: bool = False
    """The exactness promise. True: every row of a forward is computed bit for bit as it would be alone (packed
    bf16 products and fp64-summed attention), so the exact mode's output is AR decoding's bit for bit. False: a
    wide forward may round a row differently from a one-token one; in fp32 the exact mode still matches AR
    decoding token for token in practice, in bf16 or fp16 a near-tie can flip."""

    prepared: bool = True
    """Whether `prepare` built this setup (False: `plain_setup`, a model refusion did not prepare)."""

    forward_costs: ForwardCosts | None = None
    """Seconds of a batch-1 forward by width: the exact mode verifies only as many copied drafts as pay for the
    wider forward (`decode.costs`). None: `recorded_costs` says whether the decoder looks them up."""

    recorded_costs: bool = False
    """Whether, while `forward_costs` is None, the decoder prices drafts by the forward costs recorded for this
    machine and model (`decode.costs.forward_costs_of`: measured once, then read from `model.calibration`'s record
    by every process). `prepare` sets it; False (a model refusion did not prepare): every draft is verified."""

    compact: bool = True
    """Decode Llama, Mistral, Qwen2 and Qwen3 models through `model.compact.CompactForward` (transformers' operations
    on the same weights without its per-layer Python: the same logits, bit for bit) where it applies; False:
    always through transformers' forward."""

    compact_forward: CompactForward | None = None
    """The `CompactForward` `prepare` built for the model, whose fused products (`model.kernels.fused`) build their weights
    once: every decoder reuses it while it still runs the model's modules. None: decoders share the one
    `compact.compact_forward` last built for the model."""

    compiled: torch.nn.Module | None = None
    """The model's forward through `torch.compile` (`model.compiled.compile_model`): the decoder then keeps the
    cache's shapes fixed and pads each forward to a width bucket, so a decode reuses a few graphs (CUDA graphs on a
    GPU). None: eager forwards (the default). Compiled kernels round bf16 differently from eager ones and from one
    width to another, so a compiled setup does not promise row-exact forwards (`row_exact` False)."""

    def replace(self, **changes) -> ModelSetup:
        return replace(self, **changes)

    def describe(self, drafts_priced: bool | None = None) -> str:
        """One line for a stats footer or a log: dtype, kernels, table, promise; and, where `drafts_priced` is False
        (no forward costs: `decode.costs.forward_costs_of` gave None), that drafts are not priced."""
        table = f"draft table {len(self.draft_table.followers)} runs" if self.draft_table else "no draft table"
        promise = "row-exact" if self.row_exact else "rows may round differently by width"
        compiled = ", compiled" if self.compiled is not None else ""
        dtype = f"{self.kernels.dtype}, " if self.kernels.dtype else ""
        pricing = ", drafts not priced (a slow one-token forward: every draft verified)" if drafts_priced is False \
            else ""
        return (f"{dtype}linear {self.kernels.linear}, attention {self.kernels.attention}{compiled}, {table}, "
                f"{promise}{pricing}")


def attach_setup(model, setup: ModelSetup) -> ModelSetup:
    """Make `setup` the one `setup_of(model)` returns (the one place a setup is attached); returns it."""
    setattr(model, _ATTRIBUTE, setup)
    return setup


def setup_of(model) -> ModelSetup:
    """The setup `prepare` attached to `model`, else `plain_setup(model)`."""
    setup = getattr(model, _ATTRIBUTE, None)
    return setup if isinstance(setup, ModelSetup) else plain_setup(model)


def plain_setup(model) -> ModelSetup:
    """The setup of a model refusion did not prepare: tokens from its configs, no draft table, its kernels as they
    are (read off its modules), and the promise those kernels give."""
    from refusion.model.kernels.choice import forwards_row_exact

    linear = linear_kernel_of(model)
    attention = _attention_of(model)
    return ModelSetup(special_tokens=resolve_special_tokens(model),
                      kernels=Kernels(linear, attention, "not prepared by refusion: the kernels as the model was "
                                                         "built (refusion.prepare(model, tokenizer) chooses them)",
                                      _dtype_of(model)),
                      adapter_gate=_adapter_gate_of(model), row_exact=forwards_row_exact(model, linear, attention),
                      prepared=False)


def prepare(model, tokenizer=None, *, directory: str | Path | None = None, linear: str = "auto",
            weights_file: str | Path | None = None, compile: bool = False) -> ModelSetup:
    """Choose the kernels of a loaded model, resolve its special tokens, find its draft table, and attach the
    resulting `ModelSetup` (what `refusion.load` does after loading; call it on a model loaded another way).

    Args:
        model: a transformers causal LM, on the device and in the dtype it will decode in.
        tokenizer: its tokenizer (EOS and mask tokens are also read from it); None: the configs only.
        directory: where the model's files are; a `draft_table.safetensors` there becomes the setup's table.
        linear: "auto" (packed bf16 products on a CPU with native bf16 (AMX, AVX512-BF16), else weight-major
            few-token products where the probe measures them faster, else packed fp32 ones where MKL has them and
            they measure faster, else plain; the probes run once per machine and model and are recorded:
            `model.calibration`), or "plain" / "packed" / "narrow" / "sgemm" to pin the choice, or "int4" to
            multiply by the 4-bit blocks of `weights_file` (bf16 on the CPU; other numbers than bf16 weights), or
            "int4-q8" to multiply them by rows rounded to 8-bit blocks (fp32 models; llama.cpp's arithmetic).
        weights_file: the GGUF file the model was loaded from (what "int4" reads), or None.
        compile: run decoding forwards through `torch.compile` over fixed shapes (`refusion.model.compiled`;
            CUDA graphs on a GPU); the first forwards of each width compile (seconds to a minute).

    Nothing here is timed at every start: the kernels follow the CPU's features and the probes' record, and the
    forward costs that price the exact mode's drafts are read (or measured once) by the decoder
    (`ModelSetup.recorded_costs`).
    """
    from refusion.model.compact import compact_forward
    from refusion.model.compiled import compile_model
    from refusion.model.embedded import preset_for
    from refusion.model.kernels.choice import choose_linear_kernel, forwards_row_exact

    check_linear(linear)
    if not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r} is invalid: must be True or False")
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise ValueError("prepare: this model was already prepared (its setup is refusion.setup_of(model)); "
                         "load it again to choose other kernels")
    table_path = Path(directory) / TABLE_FILE if directory is not None else None
    table = DraftTable.load(table_path) if table_path is not None and table_path.is_file() else None
    linear_kernel, reason = choose_linear_kernel(model, linear, weights_file)
    attention = _attention_of(model)
    tokens = resolve_special_tokens(model, tokenizer)
    if tokens.eos_token_ids:  # transformers' own `generate` (and a saved copy) stops where refusion does
        eos = tokens.eos_token_ids
        model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else list(eos)
    setup = ModelSetup(
        special_tokens=tokens, kernels=Kernels(linear_kernel, attention, reason, _dtype_of(model)), draft_table=table,
        preset=preset_for(directory), adapter_gate=_adapter_gate_of(model),
        row_exact=forwards_row_exact(model, linear_kernel, attention) and not compile,
        compact_forward=compact_forward(model), recorded_costs=True,
        compiled=compile_model(model) if compile else None)
    _log.info("prepared: %s (%s)", setup.describe(), reason)
    return attach_setup(model, setup)


def check_promise(model, setup: ModelSetup, strategy: str) -> None:
    """Warn once per model when `generate` decodes a model refusion did not prepare: it decodes as built, without
    the kernels and draft table `prepare` gives (`Unprepared`), and, in the exact mode, in a dtype where `prepare`
    would have made it row-exact, with a weaker promise (`WeakerPromise`). Neither is ever silent."""
    if setup.prepared or model in _warned:
        return
    if not _weaker_promise(model, setup, strategy):
        _warned.add(model)
        warnings.warn("this model was not prepared by refusion: it decodes with its kernels as built and no draft "
                      "table; refusion.prepare(model, tokenizer) once chooses faster kernels (the same tokens) and "
                      "finds its draft table (refusion.load does it)", Unprepared, stacklevel=3)


def _weaker_promise(model, setup: ModelSetup, strategy: str) -> bool:
    """Warn (and say True) when the exact mode decodes an unprepared bf16 model whose rows `prepare` would make
    exact."""
    if setup.row_exact or strategy != "speculative":
        return False
    import torch

    from refusion.model.kernels.row_exact import packing_available

    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype != torch.bfloat16:
        return False
    if not packing_available():
        return False
    _warned.add(model)
    warnings.warn("this bf16 model was not prepared by refusion, so the exact mode's rows may round differently "
                  "from AR decoding's (a near-tie can flip a token); refusion.prepare(model, tokenizer) makes its "
                  "forwards row-exact (load it with attn_implementation='refusion_exact')", WeakerPromise, stacklevel=4)
    return True


def _dtype_of(model) -> str:
    parameter = next(model.parameters(), None)
    return str(parameter.dtype).removeprefix("torch.") if parameter is not None else ""


def _attention_of(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "sdpa"


def _adapter_gate_of(model) -> str:
    from refusion.model.kernels.gated_lora import MaskGatedLoRA

    return "mask" if any(isinstance(m, MaskGatedLoRA) for m in model.modules()) else "none"
