"""Whether this host has work, and for how long it has had none (``IdleClock``).

Work is a job running, queued or preparing on the slice, a warm session holding
it (the gateway's scheduler says so with ``note``), a payload on its way in, or
this host's part of another gateway's job (a multislice's): each of those
``hold``s the clock while it lasts. Reading a finished job's logs is not work.

The clock's thread sleeps on a condition: woken when the work comes and goes,
and once when the idle time is up (``seconds``), it then calls ``on_idle``
(outside its lock). ``on_idle`` returns whether it is done; if not, the clock
starts again, for another full idle time. ``IdleClock.never()`` is a clock
with no thread, for an agent that deletes nothing: every call on it is cheap.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class IdleClock:
    def __init__(self, seconds: float | None, on_idle: Callable[[float], bool]) -> None:
        """``on_idle(idle_seconds)`` runs in the clock's thread once nothing has
        been held for ``seconds``; None: never (no thread)."""
        self.seconds = seconds
        self._on_idle = on_idle
        self._cond = threading.Condition()
        self._scheduler_busy = False
        self._holds = 0
        self._since = time.monotonic()        # idle since (while idle)
        self._stopped = False
        self.done = False                     # on_idle said it is done
        self._thread: threading.Thread | None = None

    @classmethod
    def never(cls) -> IdleClock:
        return cls(None, lambda _: True)

    def start(self) -> IdleClock:
        if self.seconds is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="idle-clock")
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def note(self, busy: bool) -> None:
        """The scheduler's word: a job runs, waits or a warm session holds the
        slice (``busy``), or none does. Cheap: called on every change it makes."""
        if self.seconds is None:
            return
        with self._cond:
            if busy != self._scheduler_busy:
                self._scheduler_busy = busy
                self._restart()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Work while inside (a payload coming in, a peer's part of a job)."""
        if self.seconds is None:
            yield
            return
        with self._cond:
            self._holds += 1
            self._restart()
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._restart()

    def touch(self) -> None:
        """Something short came that a job will follow (its large arguments):
        the idle time starts again."""
        if self.seconds is None:
            return
        with self._cond:
            self._restart()

    def idle_for(self) -> float:
        """Seconds since the last work ended (0 while there is work)."""
        with self._cond:
            return 0.0 if self._busy() else time.monotonic() - self._since

    def _busy(self) -> bool:
        return self._scheduler_busy or self._holds > 0

    def _restart(self) -> None:
        """(With ``_cond`` held.) Work came or went: the idle time counts from now."""
        self._since = time.monotonic()
        self._cond.notify_all()

    def _loop(self) -> None:
        assert self.seconds is not None
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    left = self._since + self.seconds - time.monotonic()
                    if self._busy():
                        self._cond.wait()
                    elif left > 0:
                        self._cond.wait(left)
                    else:
                        idle = time.monotonic() - self._since
                        break
            try:
                done = self._on_idle(idle)
            except Exception:  # noqa: BLE001 - the clock must go on
                log.exception("the idle action failed")
                done = False
            with self._cond:
                if done:
                    self.done = True
                    return
                self._since = time.monotonic()     # another full idle time first
