"""A live worker's Python stacks, on demand (faulthandler on a signal)."""

from __future__ import annotations

import os
import time

from remote_tpu._core.limits import STACKS_CHARS, cut_text

from remote_tpu_agent.worker import child as _worker


def dump_stacks(pid: int, path: str, wait: float = 1.0) -> str:
    """Every thread's Python stack in the worker ``pid``, as it is now: it
    appends them to ``path`` when signalled (``worker.child.STACKS_SIGNAL``)."""
    if not os.path.exists(path):
        return f"(the worker's stack file {path} is gone: no stacks)"
    before = os.path.getsize(path)
    try:
        os.kill(pid, _worker.STACKS_SIGNAL)
    except ProcessLookupError:
        return "(the worker is not running)"
    deadline = time.monotonic() + wait
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path) if os.path.exists(path) else 0
        if now > before and now == size:
            break           # it grew, and stopped growing
        size = now
    try:
        with open(path, errors="replace") as f:
            f.seek(before)
            text = f.read()
    except OSError as exc:
        return f"(cannot read the worker's stacks: {exc})"
    if not text:
        return "(no answer: the worker did not dump its stacks in time)"
    return cut_text(text, STACKS_CHARS, f"every dump is kept in {path} on this host")
