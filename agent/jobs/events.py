"""The events of one job on one agent: bounded where the bytes are.

Output events wait while more than ``max_output_bytes`` of output sit unread,
so a worker that prints faster than its consumer can take (the job store's
disk, a gateway's link) is slowed by its own pipe filling up, not by the agent
growing. Everything else (started, done, exited, controls) never waits: those
events are few, and they are what ends a job. ``close()`` releases any waiting
producer for good once nobody reads any more.
"""

from __future__ import annotations

import collections
import queue
import threading

from remote_tpu._core.proto import remote_tpu_pb2 as pb

MAX_OUTPUT_BYTES = 16 << 20


def _output_size(item: object) -> int:
    if isinstance(item, pb.Event) and item.HasField("output"):
        return len(item.output.data)
    return 0


class EventQueue:
    def __init__(self, max_output_bytes: int = MAX_OUTPUT_BYTES) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._output = 0
        self._max = max_output_bytes
        self._closed = False

    def put(self, item: object, wake: bool = True) -> None:
        """Add ``item``; ``wake=False``: without waking the reader (a later
        item that wakes it brings this one too)."""
        size = _output_size(item)
        with self._cond:
            if size:
                self._cond.wait_for(lambda: self._output < self._max or self._closed)
                if self._closed:
                    return            # nobody will read it
                self._output += size
            self._items.append(item)
            if wake or size:
                self._cond.notify_all()

    def get(self, timeout: float | None = None) -> object:
        """The next event; raises ``queue.Empty`` after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise queue.Empty
            item = self._items.popleft()
            size = _output_size(item)
            if size:
                self._output -= size
                self._cond.notify_all()
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
