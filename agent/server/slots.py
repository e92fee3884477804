"""Long-lived calls get a bounded number of the server's threads.

gRPC's synchronous server runs each call on a thread of one pool. Streams
(attached runs, log followers, uploads) hold theirs for as long as they last;
unbounded, they would take every thread and leave Health, Status and Cancel
waiting. Each kind of stream takes a slot here first, and is refused at once,
saying why, when none is free. The pool is sized for every slot plus a reserve
that only short calls use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

RESERVE_THREADS = 32          # for unary calls (Health, Status, Cancel, ...)


class Slots:
    def __init__(self, size: int, what: str, advice: str) -> None:
        self.size = size
        self._what = what
        self._advice = advice
        self._free = threading.BoundedSemaphore(size)

    def take(self, context: grpc.ServicerContext, where: str) -> Callable[[], None]:
        """A slot for this call, or abort RESOURCE_EXHAUSTED. Returns the
        release function (idempotent; also run when the call ends)."""
        if not self._free.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the agent at {where} already serves {self.size} {self._what}, "
                          f"its limit: {self._advice}")
        lock = threading.Lock()
        held = [True]

        def release() -> None:
            with lock:
                if not held[0]:
                    return
                held[0] = False
            self._free.release()
        context.add_callback(release)
        return release
