"""The worker's Python output: block-buffered, flushed on a timer.

Python writes to ``sys.stdout`` go through a 64 KiB buffer instead of one
``write`` system call per line (``PYTHONUNBUFFERED``, which the agent's own
environment may carry, made a tight print loop many times slower; figures:
benchmarks/README.md); ``sys.stderr`` is
line-buffered, as Python keeps it (the last lines before a crash are the ones
that matter). A thread flushes both every ``FLUSH_SECONDS``, so a lone ``print`` still reaches
the caller at once, as far as a person can tell; they are flushed as well at
each call's end (``flush``), before a fork (so a child does not print the
parent's buffer again) and before ``os._exit``. C-level output (XLA, libtpu)
goes to the same pipes unbuffered, as before: within one stream, a Python line
can show after C output written up to ``FLUSH_SECONDS`` later. Nothing is
dropped; only a process killed outright (SIGKILL, a crash in C) loses what it
printed to stdout in its last ``FLUSH_SECONDS``. A forked child starts its own
flusher; a user who replaces ``sys.stdout`` still has ours flushed.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
import threading
import time

FLUSH_SECONDS = 0.05
BUFFER_BYTES = 1 << 16


_ours: list[io.TextIOWrapper] = []     # flushed even if the user replaces sys.stdout
# Held while the flusher rests: a spare waiting for its first call prints
# nothing, and 64 of them woke 20 times a second each for it.
_gate = threading.Lock()


def _stream(fd: int, like: io.TextIOBase | None, lines: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    stream = io.TextIOWrapper(io.BufferedWriter(raw, BUFFER_BYTES),
                              encoding=getattr(like, "encoding", None) or "utf-8",
                              errors=getattr(like, "errors", None) or "backslashreplace",
                              line_buffering=lines, write_through=False)
    _ours.append(stream)
    return stream


_c_fflush = None        # libc's fflush, looked up by ``buffer_output`` (30 us a lookup)


def flush() -> None:
    """Python's buffers (ours, and whatever ``sys.stdout``/``sys.stderr`` now
    are), then C's."""
    _flush_python()
    if _c_fflush is not None:
        try:
            _c_fflush(None)
        except Exception:  # noqa: BLE001
            pass


def _flush_python() -> None:
    for stream in (sys.stdout, sys.stderr, *_ours):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a user's replacement may fail as it likes
            pass


def _flush_forever() -> None:
    # Calls only C functions in its loop: this thread's Python frames never
    # change, so the stacks dump (faulthandler, from a signal, reading every
    # thread's frames as they are) never meets one half made or half gone.
    sleep, interval, ours, gate = time.sleep, FLUSH_SECONDS, _ours, _gate
    while True:
        sleep(interval)
        gate.acquire()
        gate.release()
        for stream in (sys.stdout, sys.stderr, *ours):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a user's replacement may fail as it likes
                pass


def buffer_output() -> None:
    """Replace ``sys.stdout``/``sys.stderr`` (and their ``__stdout__`` twins)
    with buffered streams on file descriptors 1 and 2; start the flusher."""
    global _c_fflush
    sys.stdout = sys.__stdout__ = _stream(1, sys.stdout, lines=False)
    # stderr stays line-buffered, as Python keeps it: the last words before a
    # crash or a kill are the ones that matter.
    sys.stderr = sys.__stderr__ = _stream(2, sys.stderr, lines=True)
    os.register_at_fork(before=_flush_python, after_in_child=_start_flusher)
    real_exit = os._exit

    def _exit(code: int) -> None:
        _flush_python()
        real_exit(code)
    _exit.__doc__ = real_exit.__doc__
    os._exit = _exit
    _start_flusher()
    _gate.acquire()         # until the first call: ``resume``
    try:                # (once, before any call: a spare's first call need not)
        _c_fflush = ctypes.CDLL(None).fflush
    except Exception:  # noqa: BLE001
        pass


def resume() -> None:
    """Let the flusher go on (it rests from ``buffer_output`` on)."""
    if _gate.locked():
        _gate.release()


def _start_flusher() -> None:
    """(Also in a forked child, where the parent's thread does not exist, and
    where the gate it copied may be held.)"""
    global _gate
    _gate = threading.Lock()
    threading.Thread(target=_flush_forever, daemon=True, name="remote-tpu-flush").start()
