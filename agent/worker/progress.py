"""A look at each worker every second or so: its CPU time (progress for the
gateway's stall watch), its memory and its host's TPU (``remote-tpu top``).

A host whose worker keeps using the CPU (a computation on the host, data
loading, a compile) is not stalled even when it prints nothing. A worker that
only waits (in a sleep, on a lock, in a collective that blocks, on a TPU step
that barely touches the host's CPU) uses almost none. What this cannot tell
apart: a worker spinning in a busy loop, or a collective that polls, looks busy. The CPU counted is the worker's and that of every process under it
(a data loader's workers, a compiler).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker.tpu_usage import tpu_usage

log = logging.getLogger(__name__)

BUSY_SHARE = 0.05          # of one core, over a look's interval: progress
LOOK_SECONDS = 1.0         # at most this long between looks (shorter for a short stall_after)
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _own_cpu(pid: int) -> tuple[float, list[int]] | None:
    """(CPU seconds of the process and of its children it has waited for,
    its live children), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        cpu = sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICKS  # utime stime cutime cstime
    except (OSError, IndexError, ValueError):
        return None
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                children += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass                        # (no children files here: the process alone)
    return cpu, children


def cpu_seconds(pid: int) -> float | None:
    """The CPU time so far of the process and every process under it (a data
    loader's, a compiler's), or None where the process cannot be read (gone;
    not Linux)."""
    own = _own_cpu(pid)
    if own is None:
        return None
    total, todo, seen = own[0], list(own[1]), {pid}
    while todo and len(seen) < 4096:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        found = _own_cpu(child)
        if found is not None:
            total += found[0]
            todo += found[1]
    return total


def rss_bytes(pid: int) -> int:
    """The process's resident memory (0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class CpuWatch:
    """One thread for every watched worker of this agent: each looked at
    every ``min(LOOK_SECONDS, stall_after / 4)``, a progress event each time
    (``busy`` where it used at least ``BUSY_SHARE`` of a core since the last
    look). The thread sleeps while nothing is watched (an idle agent pays
    nothing)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: dict[object, list] = {}    # key: [pid, every, next, cpu, progress]
        self._thread: threading.Thread | None = None

    def watch(self, key: object, pid: int, stall_after: float,
              progress: Callable[[pb.Progress], None]) -> None:
        """Watch ``pid`` for ``key`` (a call) until ``forget(key)``. Cheap on
        a call's path: a dict entry; the thread is woken only from its rest
        (its first look at the process takes its CPU time so far)."""
        every = min(LOOK_SECONDS, max(stall_after / 4, 0.1))
        with self._cond:
            idle = not self._watched
            self._watched[key] = [pid, every, time.monotonic() + every, None, progress]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="cpu-watch")
                self._thread.start()
            elif idle:
                self._cond.notify()

    def forget(self, key: object) -> None:
        """The call is over: no more events for it. (Its entry goes at the
        thread's next look, so that a warm session's next call, milliseconds
        later, finds the thread awake and need not wake it.)"""
        with self._cond:
            entry = self._watched.get(key)
            if entry is not None:
                entry[4] = None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._watched)
                now = time.monotonic()
                due = [(k, w) for k, w in self._watched.items() if w[2] <= now]
                for key, w in due:
                    if w[4] is None:               # forgotten
                        del self._watched[key]
                wait = min((w[2] for w in self._watched.values()), default=0) - now
            if not due:
                with self._cond:
                    self._cond.wait(max(wait, 0.01))
                continue
            for key, w in due:
                try:
                    self._look(key, w, now)
                except Exception:  # noqa: BLE001 - one look's failure stops no other
                    log.exception("a look at worker %s failed", w[0])
                    w[2] = now + w[1]

    def _look(self, key: object, w: list, now: float) -> None:
        pid, every, _, last, progress = w
        if progress is None:
            return
        cpu = cpu_seconds(pid)
        if cpu is None:
            self.forget(key)
            return
        w[2], w[3] = now + every, cpu
        if last is not None:
            progress(pb.Progress(cpu_seconds=cpu, busy=cpu - last >= BUSY_SHARE * every,
                                 rss_bytes=rss_bytes(pid), tpu=tpu_usage()))


CPU = CpuWatch()        # this agent's
