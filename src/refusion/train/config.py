"""TrainConfig: every setting of a `refusion train` run (docs/TRAINING.md), validated up front.

The CLI flags and the recipe YAML keys are these field names (``--grad-accum`` sets ``grad_accum``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from refusion.config import field_docs
from refusion.model.adapter import LORA_GATES, is_adapter_dir
from refusion.train.trackers import TRACKERS

__all__ = ["DEFAULT_SLOT_SIZES", "MIXED_PRECISION", "OBJECTIVES", "TrainConfig", "field_docs"]

OBJECTIVES = ("hybrid", "ar")
MIXED_PRECISION = ("auto", "bf16", "fp16", "no")
DEFAULT_SLOT_SIZES = (4, 8, 16, 32)


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid: {allowed}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run. Defaults follow the paper's objective and its reference run (docs/TRAINING.md)."""

    # --- what to train on, where to write ---
    model: str = ""
    """Base model: a Hugging Face directory or hub id, or a .gguf file. `<|mask|>` is added when missing."""

    data: tuple[str, ...] = ()
    """Training data: JSON / JSONL files of {"query", "response"} or {"messages": [...]} records, or the
    built-in train splits "gsm8k", "mbpp" (task ids 601-974) and "math" read from `data_dir`."""

    output: str = ""
    """Output directory: checkpoints/, metrics.jsonl, and at the end a standard HF model directory."""

    data_dir: str | None = None
    """Folder of the built-in data sets; None: $REFUSION_DATA_DIR, else ../shared/data next to the project root,
    else the Hugging Face hub (`refusion.data_files`)."""

    max_samples: int | None = None
    """Use at most this many records of each data source (None: all). For quick runs and benchmarks."""

    # --- schedule ---
    max_steps: int | None = None
    """Number of optimizer steps. Exclusive with `epochs`; when both are None, one epoch."""

    epochs: float | None = None
    """Number of passes over the data (fractions allowed). Exclusive with `max_steps`."""

    batch_size: int = 8
    """Samples per micro-batch on each process."""

    grad_accum: int = 1
    """Micro-batches per optimizer step. Global batch = batch_size * grad_accum * number of processes."""

    lr: float = 2e-5
    """Peak learning rate of the cosine schedule (reference run: 2e-5)."""

    warmup_steps: int = 0
    """Linear warm-up steps before the cosine decay (reference run: none)."""

    weight_decay: float = 0.0
    """AdamW weight decay (reference run: none)."""

    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""

    max_length: int = 2048
    """Longest prompt + response (+ EOS slots) in tokens; longer samples are skipped and counted, never cut."""

    # --- the objective (docs/TRAINING.md) ---
    objective: str = "hybrid"
    """"hybrid": AR loss on permuted clean slots + MDM loss on masked slots (ReFusion);
    "ar": plain next-token fine-tuning on the same data (the baseline)."""

    slot_sizes: tuple[int, ...] = DEFAULT_SLOT_SIZES
    """Slot size k is drawn uniformly per sample from these."""

    mdm_weight: float = 1.0
    """lambda: loss = L_AR + lambda * L_MDM."""

    eos_slots: int = 0
    """Extra always-masked slots appended past EOS and labelled EOS (teaches that masks beyond the end
    are EOS). 0, the spec's behaviour, appends none."""

    chain_fraction: float = 0.0
    """Share of the hybrid objective's samples laid out for the exact mode's drafts instead of as slots: the answer
    clean and in order, then chains of masks, each drafting the tokens after one prefix of the answer and reading
    only that prefix (docs/TRAINING.md, "Draft chains"). 0, the paper's objective, lays out none."""

    chain_masks: int = 9
    """Masks per draft chain: the first stands for the token AR decoding gives next, the others draft the ones
    after it (the decoder's `draft_length` + 1)."""

    chain_stride: int = 4
    """Tokens between the starts of consecutive chains of one sample (from a random offset): a chain sample is
    about prompt + response x (1 + chain_masks / chain_stride) tokens long."""

    logits_on_labels: bool = True
    """Apply the LM head only at positions that have a label (same loss, less compute)."""

    bucket_by_length: bool = False
    """Group samples of similar length into the same micro-batch (less padding); batches stay shuffled."""

    # --- model ---
    lora: bool = False
    """Train a LoRA adapter (peft) plus the mask-token embedding row instead of all weights."""

    lora_rank: int = 16
    """LoRA rank r."""

    lora_alpha: int = 32
    """LoRA scaling alpha."""

    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""

    lora_target_modules: str = "all-linear"
    """peft target_modules: "all-linear" or a comma-separated list of module names."""

    lora_init: str | None = None
    """Start the LoRA weights (and the mask row) from a saved adapter directory, e.g. output/adapter of an
    earlier LoRA run on the same base, instead of a fresh adapter; its rank and targets are kept."""

    lora_gate: str = "none"
    """Where the LoRA update applies: "none" (every position; merged at load) or "mask" (only at positions whose
    input is <|mask|>: clean tokens, hence AR decoding and verification, stay exactly the base model's; the
    adapter only drafts. docs/TRAINING.md, "Mask-gated adapters")."""

    merge_lora: bool = True
    """After a LoRA run, also write the merged full model to the output directory (the adapter is always
    saved in output/adapter). Ignored for a mask-gated adapter, which cannot be merged."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower)."""

    mixed_precision: str = "auto"
    """"auto" (bf16 when the device supports it), "bf16", "fp16" or "no". Master weights stay fp32."""

    eos_token: str | None = None
    """Token ending each response; None takes the turn-end token of the chat template (e.g. <|im_end|>),
    falling back to the tokenizer's EOS."""

    # --- bookkeeping ---
    seed: int = 0
    """Seed of data order, slot sizes, masking and permutations (each batch has its own derived generator)."""

    save_every: int = 500
    """Write a resumable checkpoint every this many optimizer steps (0: none besides the final model)."""

    log_every: int = 1
    """Write a metrics.jsonl line every this many optimizer steps."""

    report_to: tuple[str, ...] = ()
    """Experiment trackers (accelerate's, e.g. tensorboard or wandb; comma-separated) that also receive each
    metrics.jsonl line. Local by default: wandb runs offline unless WANDB_MODE is set (train/trackers.py)."""

    num_workers: int = 1
    """Data-loader worker processes building batches (0: in the training process)."""

    resume: str | None = None
    """"latest" (newest checkpoint in output/checkpoints) or a checkpoint directory; None starts fresh."""

    overwrite: bool = False
    """Allow starting fresh in an output directory that already holds a finished model (nothing is deleted;
    files are overwritten as they are rewritten)."""

    def __post_init__(self) -> None:
        self._validate_paths()
        self._validate_schedule()
        self._validate_objective()
        self._validate_model_options()

    def _validate_paths(self) -> None:
        _require(isinstance(self.model, str) and bool(self.model), "model", self.model, "a model path or id is required")
        _require(isinstance(self.data, tuple) and len(self.data) > 0 and all(isinstance(d, str) for d in self.data),
                 "data", self.data, "at least one data file or built-in data set name is required")
        _require(isinstance(self.output, str) and bool(self.output), "output", self.output,
                 "an output directory is required")
        _require(self.max_samples is None or (_is_int(self.max_samples) and self.max_samples >= 1),
                 "max_samples", self.max_samples, "must be an integer >= 1 or None")

    def _validate_schedule(self) -> None:
        _require(self.max_steps is None or self.epochs is None, "max_steps", self.max_steps,
                 f"give either max_steps or epochs, not both (epochs={self.epochs})")
        _require(self.max_steps is None or (_is_int(self.max_steps) and self.max_steps >= 1),
                 "max_steps", self.max_steps, "must be an integer >= 1")
        _require(self.epochs is None or (_is_number(self.epochs) and self.epochs > 0),
                 "epochs", self.epochs, "must be > 0")
        for name in ("batch_size", "grad_accum", "max_length", "log_every"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "must be an integer >= 1")
        for name in ("warmup_steps", "save_every", "num_workers", "seed"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 0, name, value, "must be an integer >= 0")
        _require(_is_number(self.lr) and self.lr > 0, "lr", self.lr, "must be > 0")
        for name in ("weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            _require(_is_number(value) and value >= 0, name, value, "must be >= 0")

    def _validate_objective(self) -> None:
        _require(self.objective in OBJECTIVES, "objective", self.objective, f"must be one of {', '.join(OBJECTIVES)}")
        _require(isinstance(self.slot_sizes, tuple) and len(self.slot_sizes) > 0
                 and all(_is_int(k) and k >= 1 for k in self.slot_sizes),
                 "slot_sizes", self.slot_sizes, "must be a non-empty list of integers >= 1")
        _require(_is_number(self.mdm_weight) and self.mdm_weight >= 0, "mdm_weight", self.mdm_weight,
                 "must be >= 0")
        _require(_is_int(self.eos_slots) and self.eos_slots >= 0, "eos_slots", self.eos_slots,
                 "must be an integer >= 0")
        _require(_is_number(self.chain_fraction) and 0 <= self.chain_fraction <= 1, "chain_fraction",
                 self.chain_fraction, "must be in [0, 1]")
        _require(self.chain_fraction == 0 or self.objective == "hybrid", "chain_fraction", self.chain_fraction,
                 "needs objective: hybrid")
        for name in ("chain_masks", "chain_stride"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "must be an integer >= 1")

    def _validate_model_options(self) -> None:
        _require(self.mixed_precision in MIXED_PRECISION, "mixed_precision", self.mixed_precision,
                 f"must be one of {', '.join(MIXED_PRECISION)}")
        _require(_is_int(self.lora_rank) and self.lora_rank >= 1, "lora_rank", self.lora_rank, "must be an integer >= 1")
        _require(_is_number(self.lora_alpha) and self.lora_alpha > 0, "lora_alpha", self.lora_alpha,
                 "must be > 0")
        _require(_is_number(self.lora_dropout) and 0 <= self.lora_dropout < 1,
                 "lora_dropout", self.lora_dropout, "must be in [0, 1)")
        _require(self.lora_init is None or self.lora, "lora_init", self.lora_init, "needs --lora")
        _require(self.lora_gate in LORA_GATES, "lora_gate", self.lora_gate, f"must be one of {', '.join(LORA_GATES)}")
        _require(self.lora_gate == "none" or self.lora, "lora_gate", self.lora_gate, "needs --lora")
        _require(self.lora_init is None or is_adapter_dir(self.lora_init),
                 "lora_init", self.lora_init, "must be an adapter directory (with adapter_config.json)")
        _require(self.resume is None or (isinstance(self.resume, str) and bool(self.resume)), "resume", self.resume,
                 '"latest" or a checkpoint directory')
        _require(isinstance(self.report_to, tuple) and all(t in TRACKERS for t in self.report_to), "report_to",
                 self.report_to, f"each must be one of {', '.join(TRACKERS)}")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, *, source: str = "config") -> TrainConfig:
        """Build from plain values (a recipe YAML, saved JSON): lists become tuples, unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        fixed = {}
        for key, value in values.items():
            if key in ("data", "slot_sizes", "report_to"):
                value = (value,) if isinstance(value, (str, int)) else tuple(value)
            fixed[key] = value
        return cls(**fixed)
