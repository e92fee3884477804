"""``remote_tpu.progress(step=...)``: a function on the slice says it moves on.

The stall watch (``stall_after=``, agent/gateway/stalls.py) takes a job whose
hosts all show no progress for that long to be stuck. Output and a worker's CPU
time count as progress by themselves; a training loop that prints nothing and
waits on the accelerator (a TPU step uses little host CPU) says so with this.

In a worker, the agent sets ``_sink``; a call outside one (on the caller's own
machine, say) does nothing. Cheap enough for every step: at most one message
every ``SEND_SECONDS`` leaves the process (the newest step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .exceptions import ConfigurationError

SEND_SECONDS = 0.5

_sink: Callable[[int | None], None] | None = None     # set in a worker (worker.child)
_lock = threading.Lock()
_sent_at = 0.0


def progress(step: int | None = None) -> None:
    """Tell the slice this process made progress, e.g. finished a training
    step (``step``: its number, a whole number >= 0). Counts for the stall
    watch of ``run(stall_after=...)``; outside a call it does nothing."""
    global _sent_at
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigurationError(f"remote_tpu.progress(step=...) takes a whole number >= 0 "
                                 f"(or nothing), got {step!r}")
    sink = _sink
    if sink is None:
        return
    now = time.monotonic()
    with _lock:
        if now - _sent_at < SEND_SECONDS:
            return
        _sent_at = now
    sink(step)
