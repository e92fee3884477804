"""This process's lanes: a warm session's next calls sent to its gateway on one
plain TCP connection instead of a gRPC call (the gateway's side, and why, is
in ``agent/wire/caller_lane.py``).

A call that leaves a warm session going may end with a ticket (``JobEnd.lane``);
``opened`` connects with it, and ``start`` sends the next call of this process
to that gateway on it. A lane that cannot take the call (there is none, the
gateway closed it, it broke) before the call's first event sends the call with
gRPC instead, under the same job id: the gateway runs a job id once, so nothing
runs twice. A call the gateway refuses raises what gRPC would have
(``LaneError``). One call at a time on a lane, each under an id of its own
(``_core.frame_connection``): a call made while another is on it goes on gRPC.
A forked child has no lanes (its parent's stay the parent's).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import grpc

from ._core import data_wire
from ._core.frame_connection import FrameConnection
from ._core.proto import remote_tpu_pb2 as pb

CALL, CANCEL, EVENT, END, ERROR = (data_wire.CALL, data_wire.CANCEL, data_wire.EVENT,
                                   data_wire.END, data_wire.ERROR)   # (protos/: FrameKind)

# A gateway silent this long (its host gone, the network cut) counts as gone.
SILENCE_SECONDS = 10.0

_lock = threading.Lock()
_lanes: dict[tuple[str, object], tuple[int, FrameConnection]] = {}   # idle ones, by pid


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()           # (another thread may have held it at the fork)
    for _, conn in _lanes.values():
        conn.sock.close()              # the child's copies; the parent's lanes go on
    _lanes.clear()


os.register_at_fork(after_in_child=_forget_in_child)


LaneError = data_wire.LaneError


def opened(gateway: str, credentials, ticket: pb.DataTicket) -> None:
    """Open the lane a call's end offered (an earlier one of this gateway's closes)."""
    if not ticket.port or not data_wire.worth_trying(gateway, credentials):
        return
    try:
        sock = data_wire.open_lane(gateway, ticket)
    except (data_wire.Unreachable, OSError):
        return                       # its calls go on gRPC, as before
    try:
        conn = FrameConnection(sock, (EVENT, END, ERROR), silence=SILENCE_SECONDS,
                               served=False)      # (read by each call's stream)
    except OSError:
        sock.close()
        return
    _put((gateway, credentials), conn)


def close(gateway: str) -> None:
    """Close this process's lanes to ``gateway`` (its warm workers were released)."""
    with _lock:
        gone = [_lanes.pop(key) for key in [k for k in _lanes if k[0] == gateway]]
    for pid, conn in gone:
        if pid == os.getpid():
            conn.sock.close()


def _put(key, conn: FrameConnection) -> None:
    with _lock:
        old = _lanes.pop(key, None)
        _lanes[key] = (os.getpid(), conn)
    if old is not None and old[0] == os.getpid():
        old[1].sock.close()


def _take(key) -> FrameConnection | None:
    with _lock:
        entry = _lanes.pop(key, None)
    if entry is None or entry[0] != os.getpid():      # (a forked child's is its parent's)
        return None
    return entry[1]


def start(gateway: str, credentials, request: pb.RunRequest,
          on_sent: Callable[[], None] = lambda: None) -> LaneStream | None:
    """Send a call on this process's lane to ``gateway`` (then ``on_sent``), up
    to its first event; None when it must go on gRPC instead (no lane, or it
    could not take the call). LaneError: the gateway refused the call."""
    key = (gateway, credentials)
    conn = _take(key)
    if conn is None:
        return None
    stream = LaneStream(key, conn, conn.new_id())
    try:
        conn.send(CALL, stream.id, request.SerializeToString())
        on_sent()
        first = stream.next_event()
    except LaneError:
        _put(key, conn)                # (the lane goes on: the refusal was its answer)
        raise
    except data_wire.FRAME_ERRORS:
        stream.close()
        return None
    except BaseException:
        stream.close()             # Ctrl-C: the gateway cancels the call
        raise
    if first is None:              # the call's events were over before any came
        stream.close()
        return None
    stream.first = first
    return stream


class LaneStream:
    """A call's events on a lane, read as a gRPC stream's are; ``cancel`` (or a
    stream left unfinished) closes the lane, and the gateway cancels the call."""

    def __init__(self, key, conn: FrameConnection, call_id: int) -> None:
        self._key = key
        self._conn = conn
        self.id = call_id
        self.first: pb.Event | None = None
        self._over = False

    def next_event(self) -> pb.Event | None:
        """The next event; None once the call's events are over."""
        frame = self._conn.read()
        if frame is None:
            raise ConnectionError("the gateway closed the lane")
        kind, call_id, body = frame
        if call_id != self.id:
            raise ConnectionError(f"a frame of call {call_id} on the lane of call {self.id}")
        if kind == EVENT:
            return pb.Event.FromString(body)
        self._over = True
        if kind == END:
            return None
        raise LaneError.from_body(body)                 # ERROR

    def __iter__(self) -> Iterator[pb.Event]:
        try:
            if self.first is not None:
                first, self.first = self.first, None
                yield first
            while (event := self._next()) is not None:
                yield event
        finally:
            if self._over:
                _put(self._key, self._conn)         # for the next call
            else:
                self.close()

    def _next(self) -> pb.Event | None:
        try:
            return self.next_event()
        except data_wire.FRAME_ERRORS as exc:
            self.close()
            raise LaneError(grpc.StatusCode.UNAVAILABLE,
                            f"the lane to the gateway broke during the call: {exc}", "") \
                from None

    def cancel(self) -> None:
        self.close()

    def close(self) -> None:
        """End the lane: the gateway cancels the call on it (a forked child's
        copy of the socket must not keep it open)."""
        self._over = False
        self._conn.close()
