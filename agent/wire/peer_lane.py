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

Frames, both ways: a 4-byte big-endian length, then one byte of kind and the
body (a serialized protobuf message).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from remote_tpu._core import data_wire
from remote_tpu._core.data_wire import read_frame, send_frame, shut
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
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()            # one frame at a time
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
        return self._sock is not None and not self._closed

    @property
    def ended(self) -> bool:
        """It was open, and is no more."""
        return self._sock is not None and self._closed

    def send(self, event: pb.Event) -> bool:
        """Send one event to the gateway; False once the lane is gone."""
        sock = self._sock
        if sock is None or self._closed:
            return False
        with self._lock:
            try:
                send_frame(sock, EVENT, event.SerializeToString())
                return True
            except OSError as exc:
                if not self._closed:
                    log.warning("lane to the gateway broke: %s", exc)
                self._closed = True
                return False

    def close(self) -> None:
        """End the lane (never waits: a send blocked on a full socket fails)."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            shut(sock)

    def _serve(self, sock: socket.socket) -> bytes:
        sock.settimeout(None)           # idle between calls for as long as the session
        data_wire.keep_alive(sock, SILENCE_SECONDS)
        self._sock = sock
        if self._closed:                # (close() saw no socket yet)
            shut(sock)
            return b""
        try:
            while (frame := read_frame(sock)) is not None:
                kind, body = frame
                if kind == CALL:
                    self._on_call(pb.JobSpec.FromString(body))
                elif kind == CANCEL:
                    self._on_cancel()
                else:
                    raise ConnectionError(f"unknown lane frame kind {kind}")
        except data_wire.FRAME_ERRORS as exc:
            if not self._closed:
                log.warning("lane from the gateway ended: %s", exc)
        finally:
            self.close()
        return b""


class GatewayLane:
    """The gateway's end of one peer's lane: sends calls and cancellations,
    and a reader thread hands each event to ``on_event`` until the lane ends,
    then calls ``on_end`` once with why ("" when we closed it)."""

    def __init__(self, sock: socket.socket, on_event: Callable[[pb.Event], None],
                 on_end: Callable[[str], None], name: str, silence: float) -> None:
        self._sock = sock
        self._on_event = on_event
        self._on_end = on_end
        self._lock = threading.Lock()            # one frame at a time
        self._closed = False
        self._ours = False
        sock.settimeout(None)
        data_wire.keep_alive(sock, silence)
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

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, kind: int, body: bytes = b"") -> bool:
        """Send a frame; False once the lane is gone (the call then goes on gRPC)."""
        if self._closed:
            return False
        with self._lock:
            try:
                send_frame(self._sock, kind, body)
                return True
            except OSError as exc:
                if not self._closed:
                    log.warning("lane broke on send: %s", exc)
                return False

    def close(self) -> None:
        """End the lane (never waits: a send blocked on a full socket fails)."""
        self._ours = self._closed = True
        shut(self._sock)

    def _read(self) -> None:
        why = ""
        try:
            while (frame := read_frame(self._sock)) is not None:
                kind, body = frame
                if kind != EVENT:
                    raise ConnectionError(f"unknown lane frame kind {kind}")
                self._on_event(pb.Event.FromString(body))
            why = "the peer closed the lane"
        except data_wire.FRAME_ERRORS as exc:
            why = f"the lane broke: {exc}"
        finally:
            self._closed = True
            shut(self._sock)              # a send blocked on it fails at once
            with self._lock:               # (and none is under way as it closes)
                try:
                    self._sock.close()
                except OSError:
                    pass
            self._on_end("" if self._ours else why)
