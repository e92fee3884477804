"""A warm session's lane: its calls between the gateway and a peer on one plain
TCP connection, instead of gRPC messages on the session's open ``Run`` call.

Each gRPC message costs Python CPU on each side (gRPC's own machinery), and a
warm call sends one to every peer and gets one back: most of a warm call on a
few hosts, and the gateway's whole cost per peer on many. A frame on a socket
costs a small part of that. Figures: benchmarks/README.md.

How it opens: once a peer's worker has parked after the session's first call,
the peer asks its own data port (``wire.data_port``) for a ticket, and sends it to
the gateway on the open ``Run`` call (``Event.lane``), where the gateway's
credentials were checked. The gateway connects to that port with it; the
connection then carries, from the gateway, the session's next calls (their
spec with the payload inside) and cancellations, and from the peer, every
event of those calls. No lane without a data port (TLS, ``--data-port -1``):
calls then stay on gRPC, as they do for a call whose payload is not inline.

The ``Run`` call stays the session's lifeline: ending it ends the peer's
worker, as before, and cancellations go on it too. A lane that ends between
calls costs nothing but itself (the next call goes on gRPC, and the peer
offers a new lane as it ends); one that ends while a call sent on it runs
takes the peer as lost (whether the call got there cannot be known), and the
session ends. A peer that cannot send an event on the lane sends it on the
gRPC call instead. Each end's other end counts as gone after
``SILENCE_SECONDS`` of silence (``data_wire.keep_alive``).

Frames: numbered, on the one connection kind of every side channel
(``remote_tpu._core.frame_connection``): each call the gateway sends has an id
of its own, and its events and cancellation carry it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from remote_tpu._core import data_wire
from remote_tpu._core.frame_connection import FrameConnection, OverFrames
from remote_tpu._core.proto import remote_tpu_pb2 as pb

log = logging.getLogger(__name__)

CALL = data_wire.CALL          # gateway -> peer: a JobSpec, payload inside
CANCEL = data_wire.CANCEL      # gateway -> peer: stop the worker (no body)
EVENT = data_wire.EVENT        # peer -> gateway: an Event of the call


SILENCE_SECONDS = 10.0


class PeerLane:
    """The peer's end: offered with a ticket of this agent's data port, then
    served on that port's connection thread until either side ends it."""

    def __init__(self, on_call: Callable[[pb.JobSpec], None],
                 on_cancel: Callable[[], None]) -> None:
        self._on_call = on_call
        self._on_cancel = on_cancel
        self._conn: FrameConnection | None = None
        self._call_id = 0                        # the call now on the lane
        self._closed = False
        self.offered = False

    def offer(self, data_port) -> pb.DataTicket | None:
        """A ticket for the gateway to open the lane with (once); None without
        a data port."""
        self.offered = True
        if data_port is None:
            return None
        ticket = data_port.issue(self._serve, lane=True)
        if ticket is None:
            return None
        return pb.DataTicket(port=data_port.port, nonce=data_port.nonce, ticket=ticket)

    @property
    def open(self) -> bool:
        return self._conn is not None and not self._closed

    @property
    def ended(self) -> bool:
        """It was open, and is no more."""
        return self._conn is not None and self._closed

    @property
    def _sock(self) -> socket.socket | None:
        return None if self._conn is None else self._conn.sock

    def send(self, event: pb.Event) -> bool:
        """Send one event to the gateway; False once the lane is gone."""
        conn = self._conn
        if conn is None or self._closed:
            return False
        if conn.try_send(EVENT, self._call_id, event.SerializeToString()):
            return True
        self._closed = True
        return False

    def close(self) -> None:
        """End the lane (never waits: a send blocked on a full socket fails)."""
        self._closed = True
        conn = self._conn
        if conn is not None:
            conn.shut()

    def _serve(self, sock: socket.socket) -> bytes:
        # (idle between calls for as long as the session)
        conn = FrameConnection(sock, (CALL, CANCEL), silence=SILENCE_SECONDS)
        self._conn = conn
        if self._closed:                # (close() saw no connection yet)
            conn.shut()
        conn.serve(self._frame)
        if conn.broken and not self._closed:
            log.warning("lane from the gateway ended: %s", conn.why)
        self.close()
        return b""

    def _frame(self, kind: int, call_id: int, body: bytes) -> None:
        if kind == CALL:
            spec = pb.JobSpec.FromString(body)
            self._call_id = call_id
            self._on_call(spec)
        else:                           # CANCEL
            self._on_cancel()


class GatewayLane(OverFrames):
    """The gateway's end of one peer's lane: sends calls and cancellations,
    and a reader thread hands each event to ``on_event`` until the lane ends,
    then calls ``on_end`` once with why ("" when we closed it). A
    ``wire.grpc_call.PeerChannel``, as a call on the link or on gRPC is."""

    def __init__(self, sock: socket.socket, on_event: Callable[[pb.Event], None],
                 on_end: Callable[[str], None], name: str, silence: float) -> None:
        self._conn = FrameConnection(sock, (EVENT,), silence=silence,
                                     closed_why="the peer closed the lane")
        self._on_event = on_event
        self._on_end = on_end
        self._call_id = 0                        # the last call sent on it
        self.reader = threading.Thread(target=self._read, daemon=True, name=name)
        self.reader.start()

    @classmethod
    def connect(cls, address: str, ticket: pb.DataTicket, on_event, on_end,
                name: str, silence: float = SILENCE_SECONDS) -> GatewayLane | None:
        """Open the lane a peer offered; None when its data port cannot be used."""
        try:
            sock = data_wire.open_lane(address, ticket)
        except (data_wire.Unreachable, OSError) as exc:
            log.info("no lane to %s (its calls stay on gRPC): %s", address, exc)
            return None
        return cls(sock, on_event, on_end, name, silence)

    def send(self, request: pb.RunRequest) -> bool:
        """Carry a request of the session's ``Run`` call: its next call
        (``next_call``, the payload inside: its sender's check) or the
        cancellation of the call on the lane (``control``); False for any other
        request, or once the lane is gone (it then goes on the ``Run`` call)."""
        if request.HasField("next_call"):
            self._call_id = self._conn.new_id()
            return self._conn.try_send(CALL, self._call_id,
                                       request.next_call.SerializeToString())
        if request.control == pb.CONTROL_CANCEL:
            return self._conn.try_send(CANCEL, self._call_id)
        return False

    def close(self) -> None:
        """End the lane (never waits: a send blocked on a full socket fails)."""
        self._conn.close()

    def cancel(self) -> None:
        """End the lane: only the lane (the session's ``Run`` call is its
        lifeline, and ending that ends the peer's worker)."""
        self.close()

    def _read(self) -> None:
        why = ""
        try:
            why = self._conn.serve(lambda kind, call_id, body: self._on_event(
                pb.Event.FromString(body)))
        finally:
            self._on_end("" if self._conn.ours else why)
