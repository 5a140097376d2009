"""`train(config)`: fine-tune a causal LM with the hybrid objective, on one CPU process or many GPUs.

Distribution, mixed precision, gradient accumulation and checkpoint state go through accelerate, so the
same code runs as `python -m refusion train`, under `torchrun` and under `accelerate launch` (DDP,
DeepSpeed ZeRO-2/3, FSDP; see accelerate_configs/). LoRA goes through peft.

Output directory:
    metrics.jsonl               one line per logged optimizer step (step, loss, loss_ar, loss_mdm, lr, ...); the
                                trackers of `report_to` receive the same values (train/trackers.py)
    checkpoints/step-NNNNNNN/   resumable state (model, optimizer, scheduler, RNG, trainer_state.json)
    config.json, model files    the final model, a standard HF directory with mask_token_id in its config
    adapter/                    LoRA runs: the adapter (the merged model is written to the directory itself)
    refusion_train.json         the run's config and summary
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from refusion.train.config import TrainConfig

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
SUMMARY = "refusion_train.json"
METRICS = "metrics.jsonl"
TRACE_ENV = "REFUSION_TRAIN_TRACE"  # a folder: each process writes the sample indices it trained on


@dataclass
class TrainState:
    """Where the run is; saved with every checkpoint."""

    step: int = 0
    """Optimizer steps done."""
    tokens: int = 0
    """Input tokens (prompt + response, all processes) trained on."""


@dataclass(frozen=True)
class TrainResult:
    """What `train` returns."""

    output: Path
    steps: int
    final_metrics: dict | None
    num_samples: int
    skipped_too_long: int
    ranks_in_sync: bool


# 1. output directory and checkpoints -----------------------------------------------------------------------

def list_checkpoints(output: str | Path) -> list[Path]:
    """Complete checkpoints of `output`, oldest first (a checkpoint is complete once trainer_state.json exists)."""
    root = Path(output) / CHECKPOINTS
    found = [p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def is_run_directory(output: str | Path) -> bool:
    """Whether `output` was written by `train` (its summary, metrics or checkpoints are there)."""
    output = Path(output)
    return (output / SUMMARY).is_file() or (output / METRICS).is_file() or (output / CHECKPOINTS).is_dir()


def resolve_resume(config: TrainConfig) -> Path | None:
    """The checkpoint to resume from, or None; refuses to start fresh over an earlier run (nothing is deleted)
    and to write into a non-empty directory that is not a run at all (someone else's files)."""
    output = Path(config.output)
    if output.exists() and not output.is_dir():
        raise ValueError(f"output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not is_run_directory(output):
        raise ValueError(f"output {output} is not empty and holds no refusion training run; choose a new or empty "
                         f"--output (nothing was written)")
    checkpoints = list_checkpoints(output)
    if config.resume == "latest":
        if not checkpoints:
            raise ValueError(f"--resume: no checkpoint in {output / CHECKPOINTS}")
        return checkpoints[-1]
    if config.resume is not None:
        path = Path(config.resume)
        if not (path / TRAINER_STATE).is_file():
            raise ValueError(f"--resume {path}: not a complete checkpoint (no {TRAINER_STATE})")
        return path
    finished = (output / "config.json").is_file() or (output / "adapter").is_dir()
    if finished and not config.overwrite:
        raise ValueError(f"output {output} already holds a trained model; pass --resume to continue from its last "
                         f"checkpoint, --overwrite to train again, or choose another --output")
    if checkpoints:
        raise ValueError(f"output {output} holds checkpoints of an earlier run ({checkpoints[-1].name}); pass --resume "
                         f"to continue it, or choose another --output (checkpoints are never overwritten)")
    return None


def save_checkpoint(accelerator, output: Path, state: TrainState, config: TrainConfig, objective=None) -> Path:
    """Model, optimizer, scheduler and RNG state via accelerate, then trainer_state.json (marks it complete).
    LoRA runs also get the adapter as of this step in adapter/ (loadable with `refusion.load`)."""
    path = output / CHECKPOINTS / f"step-{state.step:07d}"
    accelerator.save_state(str(path), safe_serialization=False)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if config.lora and objective is not None:
            save_adapter(accelerator.unwrap_model(objective).model, path / "adapter", config)
        record = {"step": state.step, "tokens": state.tokens, "world_size": accelerator.num_processes,
                  "config": config.to_dict()}
        (path / TRAINER_STATE).write_text(json.dumps(record, indent=2))
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator, path: Path, config: TrainConfig) -> TrainState:
    record = json.loads((path / TRAINER_STATE).read_text())
    accelerator.load_state(str(path))
    _warn_config_changes(accelerator, record, config)
    return TrainState(step=record["step"], tokens=record["tokens"])


def _warn_config_changes(accelerator, record: dict, config: TrainConfig) -> None:
    keys = ("data", "seed", "batch_size", "grad_accum", "objective", "slot_sizes", "max_length", "max_samples", "lr")
    saved = record.get("config", {})
    changed = [k for k in keys if k in saved and json.dumps(saved[k]) != json.dumps(config.to_dict()[k])]
    if record.get("world_size") != accelerator.num_processes:
        changed.append(f"processes {record.get('world_size')} -> {accelerator.num_processes}")
    if changed and accelerator.is_main_process:
        print(f"refusion train: warning: resuming with changed settings ({', '.join(changed)}); "
              f"the run will not match an uninterrupted one")


# 2. model --------------------------------------------------------------------------------------------------

def load_model_and_tokenizer(name: str):
    """fp32 causal LM and tokenizer on the CPU (accelerate places it): an HF directory, hub id, .gguf file
    (dequantized) or alias such as "smollm2", through `refusion.load`, built by transformers (peft wraps it,
    accelerate shards it, `save_pretrained` writes it)."""
    from refusion.model.loading import load

    # plain linear layers: training's forwards are wide (F.linear whatever the kernel), and its updates would leave
    # a GGUF file's blocks ("auto" multiplies fp32 GGUF models by them) describing weights that are gone
    return load(name, dtype=torch.float32, device="cpu", implementation="transformers", linear="plain")


def apply_lora(model, config: TrainConfig, mask_token_id: int):
    """Wrap in a peft LoRA model; the mask token's embedding row stays trainable (peft trainable tokens). With
    `lora_gate="mask"` the LoRA update acts only at mask positions."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from refusion.model.adapter import gate_lora_at_masks

    # peft reads transformers' `is_gradient_checkpointing`, deprecated in v5: its FutureWarning is not the user's
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        if config.lora_init is not None:
            peft_model = PeftModel.from_pretrained(model, config.lora_init, is_trainable=True)
        else:
            targets = config.lora_target_modules
            targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
            lora_config = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                     lora_dropout=config.lora_dropout, target_modules=targets, task_type="CAUSAL_LM",
                                     trainable_token_indices=[mask_token_id])
            peft_model = get_peft_model(model, lora_config)
    if config.lora_gate == "mask":
        gate_lora_at_masks(peft_model, mask_token_id)
    return peft_model


def save_adapter(peft_model, directory: Path, config: TrainConfig, tokenizer=None) -> None:
    """The adapter (peft format, its base recorded as `config.model`) and, for a mask-gated one, the file that says
    so (`refusion.load` reads both)."""
    from refusion.model.adapter import write_adapter_gate

    # the base as the run named it ("smollm2", a directory, a hub id), not the path it was read from (for a
    # GGUF base, a directory of this machine's build cache): the adapter then loads on any machine
    base = str(Path(config.model).resolve()) if os.path.exists(config.model) else config.model
    for adapter_config in peft_model.peft_config.values():
        adapter_config.base_model_name_or_path = base
    peft_model.save_pretrained(directory)
    write_adapter_gate(directory, config.lora_gate)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def resolve_mixed_precision(choice: str) -> str:
    """"auto" -> "bf16" on a CUDA GPU or CPU that supports it, else "no"."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"


def _has_accelerator_device() -> bool:
    xpu = getattr(torch, "xpu", None)
    return (torch.cuda.is_available() or torch.backends.mps.is_available()
            or bool(xpu is not None and xpu.is_available()))


def total_steps(config: TrainConfig, per_epoch: int) -> int:
    """Optimizer steps of the run: max_steps, or epochs (default 1) of micro-batches over grad_accum."""
    if config.max_steps is not None:
        return config.max_steps
    return max(1, math.ceil((config.epochs or 1.0) * per_epoch / config.grad_accum))


# 3. metrics ------------------------------------------------------------------------------------------------

class MetricsWindow:
    """Sums of per-micro-batch values since the last log line."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.micro_batches = 0
        self.tokens = 0
        self.started = time.perf_counter()

    def add(self, parts, num_tokens: int) -> None:
        for key in ("loss", "loss_ar", "loss_mdm"):
            self.sums[key] = self.sums.get(key, 0.0) + float(getattr(parts, key).detach())
        self.micro_batches += 1
        self.tokens += num_tokens

    def flush(self, accelerator) -> dict:
        """Means over micro-batches and processes (a collective: every process calls it)."""
        values = torch.tensor([self.sums[k] / self.micro_batches for k in ("loss", "loss_ar", "loss_mdm")],
                              device=accelerator.device, dtype=torch.float64)
        values = accelerator.reduce(values, reduction="mean")
        tokens = int(accelerator.reduce(torch.tensor(self.tokens, device=accelerator.device), reduction="sum"))
        seconds = time.perf_counter() - self.started
        out = {k: round(float(v), 6) for k, v in zip(("loss", "loss_ar", "loss_mdm"), values.tolist(), strict=True)}
        out.update(tokens=tokens, tokens_per_s=round(tokens / max(seconds, 1e-9), 2))
        self.__init__()
        return out


def trim_metrics(output: Path, step: int) -> None:
    """On resume, move metrics lines past the checkpoint's step to metrics.discarded.jsonl (nothing is lost)."""
    path = output / METRICS
    if not path.is_file():
        return
    kept, discarded = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (kept if json.loads(line).get("step", 0) <= step else discarded).append(line)
    if discarded:
        with open(output / "metrics.discarded.jsonl", "a") as f:
            f.write("\n".join(discarded) + "\n")
        path.write_text("".join(line + "\n" for line in kept))


# 4. the run ------------------------------------------------------------------------------------------------

def train(config: TrainConfig, *, on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Run (or resume) training as configured; `on_step(metrics)` is called after every optimizer step."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, set_seed
    from transformers import get_cosine_schedule_with_warmup

    from refusion.model.prepare import add_mask_token
    from refusion.train.batching import BatchRecipe, MicroBatchStream
    from refusion.train.data import check_sources, load_training_data, response_eos_id
    from refusion.train.loss import HybridObjective
    from refusion.train.trackers import check_trackers, keep_offline

    # 1. output directory (before anything slow), trackers, processes, seeds
    resume_from = resolve_resume(config)
    check_sources(config.data, config.data_dir)
    check_trackers(config.report_to)
    output = Path(config.output)
    keep_offline(config.report_to, output)
    accelerator = Accelerator(
        cpu=not _has_accelerator_device(),  # lets torchrun on CPUs start gloo processes
        mixed_precision=resolve_mixed_precision(config.mixed_precision),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=config.grad_accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,
        log_with=list(config.report_to) or None,
        project_dir=str(output),
    )
    set_seed(config.seed)

    # 2. model and tokenizer, with <|mask|>
    model, tokenizer = load_model_and_tokenizer(config.model)
    mask_id = add_mask_token(model, tokenizer)
    eos_id = response_eos_id(tokenizer, config.eos_token)
    _add_generation_eos(model, eos_id)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora:
        model = apply_lora(model, config, mask_id)

    # 3. data: tokenized once; batches are built (in data-loader workers) from (seed, step, process)
    reserved = config.eos_slots * max(config.slot_sizes)
    data = load_training_data(config.data, tokenizer, eos_id=eos_id, max_length=config.max_length,
                              reserved=reserved, data_dir=config.data_dir, max_samples=config.max_samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    recipe = BatchRecipe(config.objective, config.slot_sizes, mask_id, pad_id, eos_id, config.eos_slots,
                         config.chain_fraction, config.chain_masks, config.chain_stride)
    stream = MicroBatchStream(data, recipe, seed=config.seed, batch_size=config.batch_size,
                              world_size=accelerator.num_processes, rank=accelerator.process_index,
                              bucket_by_length=config.bucket_by_length)
    steps = total_steps(config, stream.per_epoch)

    # 4. objective, optimizer, schedule (the scheduler is stepped by hand: once per optimizer step)
    objective = HybridObjective(model, mdm_weight=config.mdm_weight, logits_on_labels=config.logits_on_labels)
    parameters = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, steps)
    objective, optimizer = accelerator.prepare(objective, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    # 5. resume
    state = TrainState()
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from, config)
        if accelerator.is_main_process:
            trim_metrics(output, state.step)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        _print_start(config, data, steps, state, accelerator)
    if config.report_to:
        from refusion.train.trackers import TRACKER_PROJECT, hyperparameters, init_kwargs

        accelerator.init_trackers(TRACKER_PROJECT, config=hyperparameters(config.to_dict()),
                                  init_kwargs=init_kwargs(config.report_to, output))

    # 6. loop
    last = _run_steps(config, accelerator, objective, optimizer, scheduler, parameters, stream, state, steps,
                      output, on_step)

    # 7. final model
    in_sync = _ranks_in_sync(accelerator, parameters)
    _save_final(config, accelerator, objective, tokenizer, output)
    if accelerator.is_main_process:
        summary = {"finished": True, "steps": state.step, "tokens": state.tokens, "num_samples": len(data),
                   "skipped_too_long": data.skipped_too_long, "processes": accelerator.num_processes,
                   "ranks_in_sync": in_sync, "mask_token_id": mask_id, "eos_token_id": eos_id,
                   "final_metrics": last, "config": config.to_dict()}
        (output / SUMMARY).write_text(json.dumps(summary, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(output, state.step, last, len(data), data.skipped_too_long, in_sync)


def _run_steps(config, accelerator, objective, optimizer, scheduler, parameters, stream, state, steps, output,
               on_step) -> dict | None:
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from refusion.train.trackers import step_metrics

    start, end = state.step * config.grad_accum, steps * config.grad_accum
    loader = DataLoader(stream, batch_size=None, sampler=range(start, end), num_workers=config.num_workers,
                        persistent_workers=False, prefetch_factor=4 if config.num_workers else None)
    progress = tqdm(total=steps, initial=state.step, desc="train", disable=not accelerator.is_main_process,
                    dynamic_ncols=True)
    trace = _open_trace(accelerator)
    window, last = MetricsWindow(), None
    objective.train()
    for batch in loader:
        sample_indices = batch.pop("sample_indices")
        num_tokens = int(batch.pop("num_tokens"))
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        with accelerator.accumulate(objective):
            parts = objective(batch)
            accelerator.backward(parts.loss)
            if accelerator.sync_gradients and config.max_grad_norm > 0:
                accelerator.clip_grad_norm_(parameters, config.max_grad_norm)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        window.add(parts, num_tokens)
        if trace is not None:
            trace.write(json.dumps({"step": state.step, "samples": sample_indices.tolist()}) + "\n")
        if not accelerator.sync_gradients:
            continue
        # one optimizer step done
        state.step += 1
        progress.update(1)
        if state.step % config.log_every == 0 or state.step == steps:
            last = {"step": state.step, "epoch": round(state.step * config.grad_accum / stream.per_epoch, 4),
                    **window.flush(accelerator), "lr": scheduler.get_last_lr()[0]}
            state.tokens += last["tokens"]
            if accelerator.is_main_process:
                with open(output / METRICS, "a") as f:
                    f.write(json.dumps(last) + "\n")
                progress.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}")
            if config.report_to:
                accelerator.log(step_metrics(last), step=state.step)  # the trackers (main process only)
        if config.save_every and state.step % config.save_every == 0:
            save_checkpoint(accelerator, output, state, config, objective)
        if on_step is not None:
            on_step(last if last and last["step"] == state.step else {"step": state.step})
    progress.close()
    if trace is not None:
        trace.close()
    return last


def _open_trace(accelerator):
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"rank{accelerator.process_index}.jsonl", "a")


@torch.no_grad()
def _ranks_in_sync(accelerator, parameters) -> bool:
    """True when every process holds the same trainable weights (a cheap fp64 checksum per process)."""
    checksum = torch.stack([p.detach().double().sum() for p in parameters]).sum() if parameters else torch.zeros(())
    sums = accelerator.gather(checksum.reshape(1).to(accelerator.device))
    return bool(torch.allclose(sums, sums[0].expand_as(sums), rtol=0, atol=0))


def _add_generation_eos(model, eos_id: int) -> None:
    """Make the response EOS (e.g. <|im_end|>) stop generation of the saved model."""
    from refusion.model.setup import setup_of

    ids = list(setup_of(model).special_tokens.eos_token_ids)
    if eos_id not in ids:
        model.generation_config.eos_token_id = [eos_id, *ids]


def _save_final(config, accelerator, objective, tokenizer, output: Path) -> None:
    """Standard HF directory (merged model for LoRA runs, adapter in output/adapter); all processes call this."""
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(objective).model
    if config.lora:
        if accelerator.is_main_process:
            save_adapter(model, output / "adapter", config, tokenizer)
            if config.merge_lora and config.lora_gate == "none":
                model.merge_and_unload().save_pretrained(output)
                tokenizer.save_pretrained(output)
        accelerator.wait_for_everyone()
        return
    state_dict = accelerator.get_state_dict(objective)  # gathers sharded (ZeRO-3 / FSDP) weights
    if accelerator.is_main_process:
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        model.save_pretrained(output, state_dict=state_dict, save_function=accelerator.save)
        tokenizer.save_pretrained(output)
    accelerator.wait_for_everyone()


def merge_adapter(adapter_dir: str | Path, output: str | Path, *, base: str | None = None) -> Path:
    """Merge a saved LoRA adapter (output/adapter of a LoRA run) into its base model; write an HF directory.

    `base` is the --model of the run (needed for .gguf bases); None reads it from the adapter config."""
    from transformers import AutoTokenizer

    from refusion.model.adapter import adapter_base, adapter_gate, attach_adapter

    adapter_dir = Path(adapter_dir)
    if adapter_gate(adapter_dir) != "none":
        raise ValueError(f"{adapter_dir} is a mask-gated adapter: it acts only at mask positions and cannot be "
                         "merged into the weights; load the adapter directory itself")
    base_model, _ = load_model_and_tokenizer(base or adapter_base(adapter_dir))
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    merged = attach_adapter(adapter_dir, base_model, tokenizer)
    merged.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return Path(output)


def _print_start(config, data, steps, state, accelerator) -> None:
    global_batch = config.batch_size * config.grad_accum * accelerator.num_processes
    print(f"refusion train: {len(data)} samples ({data.skipped_too_long} skipped: longer than "
          f"max_length={config.max_length}), {accelerator.num_processes} process(es), global batch {global_batch}, "
          f"{steps} steps{f' (resuming at step {state.step})' if state.step else ''}, "
          f"mixed precision {accelerator.mixed_precision}, objective {config.objective}")
