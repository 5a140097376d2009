"""Command-line flags built from frozen config dataclasses, and the flags several commands share.

A field ``grad_accum: int = 1`` with a docstring under it becomes ``--grad-accum GRAD_ACCUM``, its help the
docstring; a ``bool`` field becomes ``--name / --no-name``; ``X | None`` takes an X; ``tuple[int, ...]`` and
``int | list[int]`` take comma-separated integers. `refusion train` builds its flags from TrainConfig this way;
generate, eval, bench and serve build their decoding flags from DecodeConfig (`add_decode_arguments`), so a
new DecodeConfig field is a new flag of each of them.
"""

from __future__ import annotations

import argparse
import dataclasses

from refusion.config import (
    PRESETS,
    DecodeConfig,
    field_docs,
    field_types,
    layered_config,
    parse_value,
    value_type,
)
from refusion.model.kernels.registry import LINEAR_CHOICES


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, *, exclude=(), special: dict | None = None,
                            help_text: dict | None = None, default_note: str | None = None, **common) -> None:
    """One flag per field of dataclass `cls` (except `exclude`), dest = the field name.

    special: extra `add_argument` keywords by field (replacing the ones derived from the type);
    help_text: help by field, instead of the field's docstring;
    default_note: appended to every help instead of the field's default ("[default: 8]");
    common: keywords given to every `add_argument` (e.g. default=None).
    """
    docs, types = field_docs(cls), field_types(cls)
    special, help_text = special or {}, help_text or {}
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        text = help_text.get(field.name, docs.get(field.name, ""))
        if default_note is not None:
            text += f" {default_note}"
        elif field.default is not dataclasses.MISSING and field.default not in (None, (), ""):
            text += f" [default: {_show(field.default)}]"
        keywords = dict(dest=field.name, help=text.replace("%", "%%"), **common)
        if field.name in special:
            keywords.update(special[field.name])
        elif value_type(types[field.name])[0] is bool:
            keywords.update(action=argparse.BooleanOptionalAction)
        else:
            keywords.update(type=argument_type(types[field.name]), metavar=field.name.upper())
        parser.add_argument("--" + field.name.replace("_", "-"), **keywords)


def argument_type(annotation):
    """The argparse `type` of a field: int, float or str themselves (argparse names them in its errors),
    else a parser of the field's text form."""
    kind, _ = value_type(annotation)
    if kind in (int, float, str):
        return kind

    def parse(text: str):
        try:
            return parse_value(annotation, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


# ------------------------------------------------------------------------------------------------------------
# the flags generate, eval, bench and serve share

def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF directory, .gguf file, hub id, or 'smollm2' (default: the embedded model)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on a GPU that has "
                                                      "it and on a CPU with native bf16 (AMX, AVX512-BF16) "
                                                      "where rows are computed exactly; else fp32 on the CPU)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--linear", default="auto", choices=LINEAR_CHOICES,
                        help="linear kernel: auto (by the CPU's features; where they do not decide, by probes timed "
                             "once per machine and recorded: `refusion calibrate`) or pinned: plain, packed "
                             "(bf16 on a CPU with native bf16, row-exact), narrow (weight-major few-token products), sgemm "
                             "(fp32 weights packed once for MKL, F.linear's bits), int4 "
                             "(a GGUF model's blocks multiplied directly on the CPU: faster; fp32: the same "
                             "weights summed in another order, bf16: other rounding than bf16 weights), "
                             "int4-q8 (fp32: those blocks times rows rounded to 8-bit blocks, llama.cpp's "
                             "arithmetic; fastest at one row, other answers than the base model's)")
    parser.add_argument("--attention", default=None, metavar="IMPL",
                        help="attention implementation: sdpa, eager, refusion_exact (row-exact) or "
                             "refusion_exact_half (row-exact over fp16 KV entries, as llama.cpp keeps them) "
                             "(default: refusion_exact for bf16 on a CPU with native bf16, refusion_exact_half for "
                             "--linear int4-q8, else sdpa)")
    parser.add_argument("--compile", action="store_true",
                        help="decode through torch.compile over fixed shapes (CUDA graphs on a GPU); the first "
                             "forwards of each width compile (seconds to a minute)")
    parser.set_defaults(loads_model=True)  # `refusion.cli.main` picks the CPU threads of such a command


def check_device(text: str | None) -> None:
    """A ValueError (one line) for a --device torch does not know or this machine does not have."""
    if text is None:
        return
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device={text} is not a device: use cpu, cuda, cuda:N, mps or xpu") from None
    backend = {"cuda": torch.cuda, "mps": torch.backends.mps, "xpu": getattr(torch, "xpu", None)}
    if device.type == "cpu":
        return
    if device.type not in backend:
        raise ValueError(f"--device={text} is not supported: use cpu, cuda, cuda:N, mps or xpu")
    module = backend[device.type]
    if module is None or not module.is_available():
        why = "this torch was built without CUDA" if device.type == "cuda" and torch.version.cuda is None \
            and torch.version.hip is None else f"no {device.type} device is available"
        raise ValueError(f"--device={text} is not available on this machine: {why} (use --device cpu)")
    count = module.device_count() if hasattr(module, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device={text} is not available on this machine: it has {count} {device.type} "
                         f"device(s), {device.type}:0 to {device.type}:{count - 1}")


def is_text(text: str) -> bool:
    """Whether a string read from the command line or a terminal is text: bytes that are not UTF-8 arrive as lone
    surrogates (Python decodes argv and stdin with surrogateescape), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(text: str | None, what: str) -> None:
    """A one-line ValueError naming `what` (a flag, "prompt 2") when `text` is not UTF-8 text."""
    if text is not None and not is_text(text):
        raise ValueError(f"{what} is not UTF-8 text: check the terminal's encoding, or convert it first (iconv)")


def load_from_args(args: argparse.Namespace, device=None):
    """(model, tokenizer) of the model flags (`add_model_arguments`); a bad --device is a one-line ValueError."""
    from refusion.model.loading import load

    check_device(device or args.device)

    return load(args.model, dtype=args.dtype, device=device or args.device, attn_implementation=args.attention,
                linear=args.linear, compile=args.compile)


def add_decode_arguments(parser: argparse.ArgumentParser, *, exclude=(), preset: bool = True,
                         default_note: str | None = None) -> None:
    """One flag per DecodeConfig field (less `exclude`), default None = "not given", and --preset."""
    add_dataclass_arguments(parser, DecodeConfig, exclude=exclude, default_note=default_note, default=None)
    if preset:
        parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                            help="named decoding settings (paper per-task settings); flags override it")


def decode_flag_values(args: argparse.Namespace) -> dict:
    """The DecodeConfig fields given as flags."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(DecodeConfig)
            if getattr(args, f.name, None) is not None}


def decode_config_from_args(args: argparse.Namespace) -> DecodeConfig:
    """The embedded model's settings (when no --model is given), then --preset, then the explicit flags."""
    from refusion.model.embedded import default_preset_or_none

    model_defaults = default_preset_or_none() if getattr(args, "model", None) is None else None
    return layered_config(model_defaults, getattr(args, "preset", None), explicit=decode_flag_values(args))
