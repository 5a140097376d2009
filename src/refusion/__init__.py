"""refusion: slot-level plan-and-infill decoding with full KV reuse for RoPE causal LMs."""

from refusion.config import PRESETS, DecodeConfig, preset
from refusion.decode.outputs import GenerationOutput, GenerationStats, RoundTrace, SequenceStats, TokenLogprob

__version__ = "0.1.0"

__all__ = [
    "DecodeConfig", "GenerationOutput", "GenerationStats", "RoundTrace", "SequenceStats", "TokenLogprob", "PRESETS",
    "preset", "load", "generate", "encode_prompts", "default_decode_settings", "prepare", "setup_of", "ModelSetup",
]


def __getattr__(name):  # heavy imports (transformers) only when used
    if name == "generate":
        from refusion.decode.loop import generate
        return generate
    if name == "default_decode_settings":
        from refusion.model.embedded import default_decode_settings
        return default_decode_settings
    if name in ("prepare", "setup_of", "ModelSetup"):
        from refusion.model import setup
        return getattr(setup, name)
    if name in ("load", "encode_prompts"):
        from refusion.model import loading
        return getattr(loading, name)
    raise AttributeError(f"module 'refusion' has no attribute {name!r}")
