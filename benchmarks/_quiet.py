"""Wait for this machine to be quiet before timing: the agents' spare workers
(``--spare-workers``) are started again after a cold call, importing jax for
about a second of CPU each, and a measurement taken meanwhile times them too."""

from __future__ import annotations

import time


def wait_quiet(timeout: float = 120.0, busy_percent: float = 15.0) -> float:
    """Block until the machine's CPUs are under ``busy_percent`` busy over half
    a second (or ``timeout`` seconds have passed); the seconds waited."""
    try:
        import psutil
    except ImportError:           # (the bench extra brings it)
        time.sleep(2.0)
        return 2.0
    start = time.monotonic()
    while psutil.cpu_percent(interval=0.5) > busy_percent:
        if time.monotonic() - start > timeout:
            break
    return time.monotonic() - start
