"""Decoding programs, one module per strategy, sharing the steps of `refusion.decode.sequence`:
`plan_and_infill` (the paper's), `speculative` (the exact mode) and `autoregressive` (the baseline)."""

from __future__ import annotations

from collections.abc import Callable

from refusion.decode.programs.autoregressive import autoregressive_program
from refusion.decode.programs.plan_and_infill import refusion_program
from refusion.decode.programs.speculative import speculative_program
from refusion.decode.sequence import Program, Sequence

PROGRAMS: dict[str, Callable[[Sequence], Program]] = {
    "refusion": refusion_program, "speculative": speculative_program, "autoregressive": autoregressive_program,
}
"""The program of each `DecodeConfig.strategy`."""


def start_program(seq: Sequence) -> Program:
    """The program that decodes `seq` with its strategy (not yet started)."""
    return PROGRAMS[seq.cfg.strategy](seq)
