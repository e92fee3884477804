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
MAX_STEP = 2 ** 63 - 1

_sink: Callable[[int | None], None] | None = None     # set in a worker (worker.child)
_lock = threading.Lock()
_sent_at = 0.0
_pending: list[int | None] = []      # the newest step held back by the rate, to send later
_timer: threading.Timer | None = None


def progress(step: int | None = None) -> None:
    """Tell the slice this process made progress, e.g. finished a training
    step (``step``: its number, a whole number >= 0). Counts for the stall
    watch of ``run(stall_after=...)`` and shows in ``remote-tpu top``;
    outside a call it does nothing. At most two messages a second leave the
    process; a step held back is sent half a second later at the latest, so
    the last one reported is never lost."""
    global _sent_at, _timer
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                             or not 0 <= step <= MAX_STEP):
        raise ConfigurationError(f"remote_tpu.progress(step=...) takes a whole number >= 0 "
                                 f"(below 2**63), or nothing; got {step!r}")
    sink = _sink
    if sink is None:
        return
    now = time.monotonic()
    with _lock:
        wait = SEND_SECONDS - (now - _sent_at)
        if wait > 0:
            _pending[:] = [step]
            if _timer is None:
                _timer = threading.Timer(wait, _send_pending)
                _timer.daemon = True
                _timer.start()
            return
        _sent_at = now
        _pending.clear()
    sink(step)


def _send_pending() -> None:
    global _sent_at, _timer
    with _lock:
        _timer = None
        if not _pending:
            return
        step = _pending.pop()
        _sent_at = time.monotonic()
    sink = _sink
    if sink is not None:
        sink(step)


def forget_in_child() -> None:
    """(After a fork.) A forked child of the worker reports nothing: its
    writes could interleave with the parent's on the agent's pipe."""
    global _sink, _lock, _timer
    _sink, _lock, _timer = None, threading.Lock(), None
    _pending.clear()
