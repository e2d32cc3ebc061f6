"""Stopping without losing work: SIGTERM/SIGINT become a checkpointed stop between steps; every
process agrees on the ``--max-minutes`` budget."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxformer.run.logs import log


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after checkpointing the current step."""

    def __init__(self, signum: int, step: int, message: str):
        super().__init__(message)
        self.signum, self.step = signum, step


class PreemptionGuard:
    """Turns SIGTERM and SIGINT into a stop the loop checks between steps; a second SIGINT ends
    the process at once (status 130, no save). Does nothing outside the main thread.

    With several processes (``multi_process``) all must stop at the same step: JAX's
    preemption service spreads SIGTERM and picks it (``reached_preemption_sync_point``); a
    SIGINT is passed on as SIGTERM. Without that service signals are not caught.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, multi_process: bool = False):
        self.received: int | None = None
        self.multi_process = multi_process
        self._interrupted = False
        self._checks = 0   # sync-point ids count from 0 in every launch (see stop_requested)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and (self._interrupted or self.received is not None):
            sys.stderr.write("second interrupt: stopped at once without saving; run the same "
                             "command again to resume from the newest complete checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signal.SIGINT)
        if self.multi_process:   # only SIGINT comes here: hand it to the preemption service
            self._interrupted = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.received = signum

    def stop_requested(self) -> bool:
        """Whether to stop before the next step; every process calls it once per step and all get
        ``True`` at the same one (JAX's sync point is asked with this launch's check count)."""
        if self.multi_process and self.received is None:
            from jax.experimental import multihost_utils

            try:
                if multihost_utils.reached_preemption_sync_point(self._checks):
                    self.received = signal.SIGTERM
            except RuntimeError as error:   # jax_enable_preemption_service is off
                log(f"multi-process run without JAX's preemption service "
                    f"({str(error).splitlines()[0]}); SIGTERM and Ctrl-C will not checkpoint")
                self.multi_process = False
                self.__exit__()   # give SIGINT back: one process alone must not stop
            self._checks += 1
        return self.received is not None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            signals = (signal.SIGINT,) if self.multi_process else self.SIGNALS
            self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def past_deadline(deadline: float, step: int, every: int) -> bool:
    """Whether the ``--max-minutes`` budget is spent; several processes agree (any one past it)
    every ``every`` steps."""
    if jax.process_count() == 1:
        return time.perf_counter() > deadline
    if step % every:
        return False
    from jax.experimental import multihost_utils

    past = multihost_utils.process_allgather(np.asarray(time.perf_counter() > deadline))
    return bool(np.any(past))
