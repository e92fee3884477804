"""profile=: a jax.profiler trace of the call, on every host, into the
process's output directory (saved under ``host_{i}/`` with the job's other
outputs), where TensorBoard's profile plugin and XProf read it
(``plugins/profile/<run>/<host>.xplane.pb``)."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

ENV_PROFILE = "REMOTE_TPU_PROFILE"      # seconds to trace ("inf": the whole call); "0": off


def call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)``, traced when this call asks for it."""
    seconds = float(os.environ.get(ENV_PROFILE, "0") or 0)
    if seconds <= 0:
        return fn(*args, **kwargs)
    import jax

    jax.profiler.start_trace(os.environ["REMOTE_TPU_OUTPUT_DIR"])
    lock, running = threading.Lock(), [True]

    def stop() -> None:
        with lock:
            if running[0]:
                running[0] = False
                jax.profiler.stop_trace()

    timer = None
    if math.isfinite(seconds):         # the first seconds of the call only
        timer = threading.Timer(seconds, stop)
        timer.daemon = True
        timer.start()
    try:
        return fn(*args, **kwargs)
    finally:
        if timer is not None:
            timer.cancel()
        stop()
