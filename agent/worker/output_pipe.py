"""Reading one of a worker's output pipes, with a barrier instead of a timer.

When the worker says it is done, everything it wrote before saying so is either
already read or still waiting in the pipe. :meth:`Pump.drain` waits exactly for
those bytes to be delivered (the bytes read so far plus what the kernel holds,
taken under the reader's lock), however many there are and however slow the
consumer: nothing the worker printed can be left behind, and nothing waits for
a user's background child that keeps the pipe open.
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import termios
import threading
from collections.abc import Callable

READ_SIZE = 65536


def _pending(fd: int) -> int:
    """Bytes waiting in the pipe ``fd``."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


class Pump:
    """Reads ``fd`` to EOF in its own thread, handing every byte to ``deliver``
    (and ``b""`` once at the end, so it can flush what it holds)."""

    def __init__(self, fd: int, deliver: Callable[[bytes], None], name: str) -> None:
        self._fd = fd
        self._deliver = deliver
        self._cond = threading.Condition()
        self._read = 0            # bytes taken from the pipe (under _cond)
        self._delivered = 0       # bytes handed to deliver (under _cond)
        self._stopped = False
        self.eof = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        os.set_blocking(self._fd, False)
        try:
            while not self._stopped:
                poller.poll(500)
                with self._cond:
                    try:
                        data = os.read(self._fd, READ_SIZE)
                    except (BlockingIOError, InterruptedError):
                        continue
                    self._read += len(data)
                if not data:
                    return
                self._deliver(data)
                with self._cond:
                    self._delivered += len(data)
                    self._cond.notify_all()
        finally:
            self._deliver(b"")
            with self._cond:
                os.close(self._fd)
                self.eof.set()
                self._cond.notify_all()

    def drain(self) -> None:
        """Return once every byte written to the pipe before this call has been
        delivered (or the pipe has ended)."""
        with self._cond:
            if self.eof.is_set():
                return
            target = self._read + _pending(self._fd)
            self._cond.wait_for(lambda: self._delivered >= target or self.eof.is_set())

    def stop(self) -> None:
        """Stop reading (the pipe is held open by something we cannot stop)."""
        self._stopped = True
