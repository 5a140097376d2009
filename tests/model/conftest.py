"""A tiny base model directory and a LoRA adapter over it: a model that refusion.load has to build."""

from __future__ import annotations

import json

import pytest
import torch

from refusion.model.tiny import tiny_model, tiny_tokenizer


@pytest.fixture
def adapter_dir(tmp_path):
    """tmp_path/base (a tiny Qwen3 without <|mask|>) and tmp_path/adapter (random LoRA on q/v over it)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    del base.config.mask_token_id
    base.save_pretrained(tmp_path / "base")
    tiny_tokenizer(with_mask=False).save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(tiny_model(), lora).save_pretrained(tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    config_path.write_text(json.dumps(config))
    return tmp_path / "adapter"
