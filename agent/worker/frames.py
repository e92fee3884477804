"""The frames an agent and its worker exchange on their two pipes.

Agent -> worker (control pipe): ``CALL`` (a call to run: its directory, the
environment it changes, the payload's digest, and the payload itself inline
or the path of a file holding it) and ``RELEASE`` (exit now). Worker -> agent
(status pipe): ``READY`` (the stacks handler is in place), ``JAX_READY``
(``jax.distributed`` initialized, for the job's timeline), ``PROGRESS``
(``remote_tpu.progress()``: the step, if given) and ``DONE`` (the call's
outcome, with process 0's pickled value inline or in a file).

A frame is one kind byte, a 4-byte header length, a JSON header, an 8-byte blob
length and the blob. Small payloads and values travel inline, so a warm call
touches no file; larger ones go through files in the call's directory.
"""

from __future__ import annotations

import json
import os
import struct

from remote_tpu._core.limits import INLINE_BYTES

CALL = b"N"
RELEASE = b"R"
READY = b"S"
DONE = b"D"
PROGRESS = b"P"
JAX_READY = b"J"
_JOINED_BYTES = 1 << 16     # a blob up to this goes in the same write as its header
__all__ = ["CALL", "DONE", "INLINE_BYTES", "JAX_READY", "PROGRESS", "READY", "RELEASE",
           "read_frame", "write_frame"]


def write_frame(fd: int, kind: bytes, header: dict | None = None, blob: bytes = b"") -> None:
    head = json.dumps(header or {}).encode()
    data = b"".join((kind, struct.pack(">I", len(head)), head,
                     struct.pack(">Q", len(blob))))
    if len(blob) <= _JOINED_BYTES:          # one write: the reader wakes once
        _write_all(fd, data + blob if blob else data)
    else:
        _write_all(fd, data)
        _write_all(fd, memoryview(blob))


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes, or None when the pipe ends first."""
    parts, left = [], n
    while left:
        try:
            part = os.read(fd, min(left, 1 << 20))
        except InterruptedError:
            continue
        except OSError:
            return None
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_frame(fd: int) -> tuple[bytes, dict, bytes] | None:
    """The next frame, or None when the pipe ends (or is garbled)."""
    start = _read_exact(fd, 5)                      # kind, header length
    if start is None:
        return None
    kind, head_size = start[:1], struct.unpack(">I", start[1:])[0]
    rest = _read_exact(fd, head_size + 8)           # header, blob length
    if rest is None:
        return None
    head = rest[:head_size]
    blob = _read_exact(fd, struct.unpack(">Q", rest[head_size:])[0])
    if blob is None:
        return None
    try:
        header = json.loads(head)
    except ValueError:
        return None
    return kind, header, blob
