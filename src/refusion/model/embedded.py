"""The embedded default model (`refusion.load()` with no path)."""

from __future__ import annotations


def embedded_source() -> tuple[str, dict]:
    """(from_pretrained source, kwargs) of the packaged default ReFusion model."""
    raise ValueError("this build of refusion ships no embedded default model yet: pass a model "
                     "(--model PATH, a HF directory, a .gguf file, a hub id, or 'smollm2' for the base AR model)")


def default_decode_settings_or_none() -> dict | None:
    """DecodeConfig kwargs tuned for the embedded model, or None while there is none."""
    return None
