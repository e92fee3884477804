"""The one connection kind of every side channel beside gRPC: a gateway's link
to a peer (``agent/wire/peer_link.py``), a warm session's lane to a peer
(``agent/wire/peer_lane.py``) and a caller's lane to its gateway
(``agent/wire/caller_lane.py``, ``remote_tpu/_call_lane.py``).

Each is a plain TCP connection (opened on a data port: ``data_wire``) that
carries numbered calls: every frame (``data_wire.send_frame``: a 4-byte
length, one byte of kind from protos/'s ``FrameKind``, the body) has a body
that starts with the 4-byte id of the call it belongs to. A link carries
several calls at once; a lane one at a time, each under its own id.

What is the same for all of them is here: one send lock (frames of several
threads never interleave), the keepalive that finds a silent other end
(``data_wire.keep_alive``), a reader loop that refuses a frame of a kind its
role never receives, one way to close, and one report of why it ended. What
each kind of frame means is its role's own.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable, Collection

from .data_wire import FRAME_ERRORS, keep_alive, read_frame, send_frame, shut

log = logging.getLogger(__name__)

ID_BYTES = 4                 # bytes of a call's id, at the start of each frame's body

Frame = tuple[int, int, bytes]          # kind, call id, the rest of the body


class FrameConnection:
    """One side channel's connection, from one end: ``accepts`` are the frame
    kinds this end may receive (any other breaks the connection), ``what``
    names it in reports ("link", "lane"). With ``silence``, the other end
    counts as gone after about that many seconds without a word
    (``keep_alive``; ``bound_unacked`` as there). ``served``: a reader loop
    (``serve``) will read it, and close it at its end; else this end reads
    it frame by frame (``read``), and ``close`` closes it at once."""

    def __init__(self, sock: socket.socket, accepts: Collection[int], *, what: str = "lane",
                 silence: float | None = None, bound_unacked: bool = True,
                 closed_why: str = "", served: bool = True) -> None:
        self.sock = sock
        self.what = what
        self._accepts = frozenset(accepts)
        self._closed_why = closed_why or f"the other end closed the {what}"
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._served = served
        self.closed = False          # shut by this end, or over
        self.ours = False            # this end closed it
        self.broken = False          # it ended on an error (not a goodbye, nor ours)
        self.why = ""                # why it ended ("" while it goes on)
        sock.settimeout(None)
        if silence is not None:
            keep_alive(sock, silence, bound_unacked)

    def new_id(self) -> int:
        """An id for the next call this end starts."""
        return next(self._ids) & 0xFFFFFFFF

    def send(self, kind: int, call_id: int, body: bytes = b"") -> None:
        """One frame of call ``call_id``. OSError: the connection is gone."""
        frame = call_id.to_bytes(ID_BYTES, "big") + body
        with self._send_lock:
            send_frame(self.sock, kind, frame)

    def try_send(self, kind: int, call_id: int, body: bytes = b"") -> bool:
        """``send``; False once the connection is gone (said once, in the log)."""
        if self.closed:
            return False
        try:
            self.send(kind, call_id, body)
            return True
        except OSError as exc:
            if not self.closed:
                log.info("the %s broke on send: %s", self.what, exc)
            return False

    def read(self) -> Frame | None:
        """The next frame; None once the other end closed the connection
        between frames. What cannot be read raises (``data_wire.FRAME_ERRORS``)."""
        frame = read_frame(self.sock)
        if frame is None:
            return None
        kind, body = frame
        if kind not in self._accepts:
            raise ConnectionError(f"unknown {self.what} frame kind {kind}")
        if len(body) < ID_BYTES:
            raise ConnectionError(f"a {self.what} frame of {len(body)} bytes carries no "
                                  "call id")
        return kind, int.from_bytes(body[:ID_BYTES], "big"), body[ID_BYTES:]

    def serve(self, handle: Callable[[int, int, bytes], None],
              ready: Callable[[], bool] | None = None,
              ending: Callable[[], None] | None = None) -> str:
        """Hand each frame to ``handle(kind, call_id, body)`` until the
        connection ends (or ``ready``, asked before each frame, says False),
        then (after ``ending``, told of it first) close it; why it ended, also
        kept as ``why`` (``ours``: this end closed it). What ``handle`` or
        ``ready`` raise of ``data_wire.FRAME_ERRORS`` breaks it."""
        why = ""
        try:
            while ready is None or ready():
                frame = self.read()
                if frame is None:
                    why = self._closed_why
                    break
                handle(*frame)
        except FRAME_ERRORS as exc:
            why, self.broken = f"the {self.what} broke: {exc}", True
        finally:
            self.closed = True
            self.why = why
            try:
                if ending is not None:
                    ending()
            finally:
                shut(self.sock)                # a send blocked on it fails at once
                with self._send_lock:          # (and none is under way as it closes)
                    try:
                        self.sock.close()
                    except OSError:
                        pass
        return why

    def shut(self) -> None:
        """Stop it both ways (never waits: a send blocked on a full socket
        fails); the reader, if one serves it, ends and closes it."""
        self.closed = True
        shut(self.sock)

    def close(self) -> None:
        """This end ends it: ``shut``, and closed at once where no reader
        serves it (under the send lock: no send is under way as it closes)."""
        self.ours = True
        self.shut()
        if not self._served:
            with self._send_lock:
                self.sock.close()


class OverFrames:
    """An end that speaks through one ``FrameConnection`` (``_conn``): whether
    it is closed, and (for tests that write to the wire themselves) its socket."""

    _conn: FrameConnection

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @property
    def _sock(self) -> socket.socket:
        return self._conn.sock
