"""The one place that stops processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

log = logging.getLogger(__name__)


def signal_name(returncode: int | None) -> str:
    """"SIGKILL" for a process killed by signal 9 (returncode -9), else ""."""
    if returncode is None or returncode >= 0:
        return ""
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)
        return False


def stop_group(proc: subprocess.Popen, grace: float = 1.0) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace``
    seconds, and reap ``proc``. Also kills what the leader left behind in its
    group, so nothing of the job survives."""
    pgid = proc.pid
    if proc.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Whether or not the leader went, anything left in its group is killed.
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
