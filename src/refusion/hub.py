"""Whether the Hugging Face hub can be asked now: one quick check instead of minutes of retries when offline."""

from __future__ import annotations

import os
import threading

TRUE_VALUES = ("1", "ON", "YES", "TRUE")
"""Values of an HF_*_OFFLINE variable that mean "offline" (as huggingface_hub reads them)."""


def offline_setting(variables: tuple[str, ...] = ("HF_HUB_OFFLINE",)) -> str | None:
    """The first of `variables` that is set to true, if any."""
    return next((name for name in variables if os.environ.get(name, "").strip().upper() in TRUE_VALUES), None)


def hub_reachable(timeout: float = 3.0, offline_variables: tuple[str, ...] = ("HF_HUB_OFFLINE",)) -> bool:
    """False when one of `offline_variables` is set, else whether the hub's endpoint accepts a connection within
    `timeout` seconds (name lookup included: it runs in a thread that is not waited for longer)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if offline_setting(offline_variables) or constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    done, answered = threading.Event(), []

    def connect():
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass
        done.set()

    threading.Thread(target=connect, daemon=True).start()
    done.wait(timeout)
    return bool(answered)
