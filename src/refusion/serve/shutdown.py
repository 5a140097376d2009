"""Clean shutdown of `refusion serve`: on SIGTERM (or Ctrl+C) drain the scheduler, then exit 0.

Left alone, uvicorn stops listening at once (new clients see "connection refused", not an answer), cuts
open streams after its graceful timeout, and re-raises the signal after shutting down, so the process dies
by SIGTERM (exit status 143). `GracefulServer` replaces its signal handler:

1. the server keeps listening, but answers new generation requests 503 `shutting_down` and `/health` 503
   `"draining"` (a load balancer takes it out of rotation);
2. the requests already accepted (decoding or queued) finish, for up to `grace` seconds (`Scheduler.drain`);
3. those still unfinished then end with a clear error: a non-streamed request gets a 503 `shutting_down`,
   a stream an `{"error": ...}` event then `data: [DONE]`;
4. uvicorn then closes the connections (waiting up to `FLUSH_SECONDS` for the last bytes), runs the app's
   shutdown (the scheduler thread stops) and `serve` returns: the process exits 0.

A second signal during the drain skips the wait (step 3 at once).
"""

from __future__ import annotations

import logging
import threading

import uvicorn

from refusion.serve.scheduler import Scheduler

log = logging.getLogger("refusion.serve")

FLUSH_SECONDS = 5
"""After the drain, how long uvicorn waits for connections to send their last bytes (its graceful timeout)."""


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM / SIGINT drain the scheduler first (module docstring)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float):
        if grace < 0:
            raise ValueError(f"shutdown grace={grace} is invalid: must be >= 0 seconds")
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread). Unlike uvicorn's it records no signal to re-raise: the exit is clean."""
        self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """Start draining (first call) or stop waiting for the requests still running (later calls)."""
        if self._drain is not None:
            log.warning("second shutdown request: ending the remaining requests now")
            self.scheduler.abort_all("the server was stopped before this request finished")
            return
        log.info("shutting down: no new requests; waiting up to %g s for %d accepted ones", self.grace,
                 len(self.scheduler.live) + len(self.scheduler.waiting))
        self._drain = threading.Thread(target=self._drain_then_exit, name="refusion-drain", daemon=True)
        self._drain.start()

    def _drain_then_exit(self) -> None:
        cut = self.scheduler.drain(self.grace)
        if cut:
            log.warning("shutdown: %d request(s) did not finish within %g s and were ended", cut, self.grace)
        self.should_exit = True
