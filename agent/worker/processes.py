"""The one place that stops processes (a worker's group, a job's installer)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

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


class Stopped(Exception):
    """Work stopped from outside (its job cancelled or timed out, its caller
    gone): the child processes it ran were killed."""


class Children:
    """The child processes one piece of work runs (preparing a job: installers,
    interpreter probes), each in a process group of its own. ``stop`` kills
    every group and refuses to start another: the work ends at once, with
    ``Stopped``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.stopped = ""            # why, once stopped

    def popen(self, cmd: Sequence[str], env: Mapping[str, str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` with exactly ``env`` (``worker.environment.child_environment``);
        ``done`` once it has exited."""
        with self._lock:
            if self.stopped:
                raise Stopped(self.stopped)
            proc = subprocess.Popen(list(cmd), env=dict(env), stdin=subprocess.DEVNULL,
                                    start_new_session=True, **kwargs)
            self._running.add(proc)
        return proc

    def done(self, proc: subprocess.Popen) -> None:
        """``proc`` is over: what it left in its group is killed; Stopped if
        the work was stopped meanwhile."""
        with self._lock:
            self._running.discard(proc)
        stop_group(proc, grace=0)
        if self.stopped:
            raise Stopped(self.stopped)

    def stop(self, why: str) -> None:
        with self._lock:
            self.stopped = self.stopped or why
            running = list(self._running)
        for proc in running:
            stop_group(proc, grace=0.5)

    def run(self, cmd: Sequence[str], env: Mapping[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """Run ``cmd`` to its end, its output captured as text; its group is
        killed past ``timeout`` (subprocess.TimeoutExpired)."""
        proc = self.popen(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace")
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, grace=0)
            raise
        finally:
            self.done(proc)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
