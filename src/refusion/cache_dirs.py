"""Where refusion keeps what it builds or copies: one root, `$REFUSION_CACHE`, else `$XDG_CACHE_HOME/refusion`, else
`~/.cache/refusion` (models/ for built models, beside them the calibration record, data/ for data copied from the
hub); `REFUSION_CACHE=off` turns every cache off."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "REFUSION_CACHE"
OFF_VALUES = ("0", "off", "none", "false", "no")
"""Values of an on/off environment variable that mean off."""


def cache_root() -> Path | None:
    """Directory of the cached models; None when the cache is turned off (`REFUSION_CACHE=off`)."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    if value:
        return Path(value).expanduser() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "refusion" / "models"
