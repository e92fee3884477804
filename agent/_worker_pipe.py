"""The frames an agent and its worker exchange on their two pipes.

Agent -> worker (control pipe): ``CALL`` (a call to run: its directory, the
environment it changes, the payload's digest, and the payload itself inline
or the path of a file holding it) and ``RELEASE`` (exit now). Worker -> agent
(status pipe): ``READY`` (the stacks handler is in place) and ``DONE`` (the
call's outcome, with process 0's pickled value inline or in a file).

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
__all__ = ["CALL", "DONE", "INLINE_BYTES", "READY", "RELEASE", "read_frame", "write_frame"]


def write_frame(fd: int, kind: bytes, header: dict | None = None, blob: bytes = b"") -> None:
    head = json.dumps(header or {}).encode()
    data = b"".join((kind, struct.pack(">I", len(head)), head,
                     struct.pack(">Q", len(blob))))
    _write_all(fd, data)
    if blob:
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
    kind = _read_exact(fd, 1)
    head_size = _read_exact(fd, 4) if kind else None
    if head_size is None:
        return None
    head = _read_exact(fd, struct.unpack(">I", head_size)[0])
    blob_size = _read_exact(fd, 8) if head is not None else None
    if blob_size is None:
        return None
    blob = _read_exact(fd, struct.unpack(">Q", blob_size)[0])
    if blob is None:
        return None
    try:
        header = json.loads(head)
    except ValueError:
        return None
    return kind, header, blob
