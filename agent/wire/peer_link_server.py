"""The peer's end of a gateway's link (``wire.peer_link``, which says what it is
and why): ``OpenLink`` hands out its ticket, and the data port's connection
thread then serves it, each call on a thread of its own as ``Run`` would be."""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core.data_wire import LaneError
from remote_tpu._core.frame_connection import FrameConnection
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.wire.caller_lane import LaneContext, serve_call
from remote_tpu_agent.wire.peer_link import (CALL, CANCEL, ERROR, HEALTH, HEALTH_REPLY,
                                             LINKED, REQUEST, SILENCE_SECONDS)

log = logging.getLogger(__name__)

PeerCall = Callable[[Iterator[pb.RunRequest], LaneContext], Iterator[pb.Event]]


class _Served:
    def __init__(self) -> None:
        self.requests: queue.Queue[pb.RunRequest | None] = queue.Queue()
        self.context = LaneContext()

    def end(self) -> None:
        """The call is over here, or its gateway ended it, or went away."""
        self.requests.put(None)
        self.context.end()


def offer_link(data_port, run: PeerCall, health: Callable[[], pb.HealthReply],
               silence: float = SILENCE_SECONDS) -> pb.DataTicket:
    """``OpenLink``: a ticket for a gateway's link on this agent's data port,
    whose calls ``run`` serves and whose health checks ``health`` answers
    (port 0: none, the gateway uses ``Run``). A gateway silent for ``silence``
    seconds (this agent's ``--peer-timeout``) is gone, and its calls end."""
    link = PeerLink(run, health, silence)
    if data_port is None or (ticket := data_port.issue(link.serve, lane=True)) is None:
        return pb.DataTicket()
    return pb.DataTicket(port=data_port.port, nonce=data_port.nonce, ticket=ticket)


class PeerLink:
    """The peer's end: serves one gateway's link on its data port connection's
    thread; each call on a thread of its own, as ``Run`` would be served."""

    def __init__(self, run: PeerCall, health: Callable[[], pb.HealthReply],
                 silence: float = SILENCE_SECONDS) -> None:
        self._run = run
        self._health = health
        self._silence = silence
        self._conn: FrameConnection | None = None
        self._lock = threading.Lock()
        self._calls: dict[int, _Served] = {}

    def serve(self, sock: socket.socket) -> bytes:
        self._conn = FrameConnection(sock, (CALL, REQUEST, CANCEL, HEALTH), what="link",
                                     silence=self._silence)
        try:
            self._send(LINKED, 0)             # taken (not refused: lanes full)
            self._conn.serve(self._frame)
        except OSError as exc:
            self._conn.shut()
            log.info("a gateway's link ended: %s", exc)
        finally:
            with self._lock:
                calls = list(self._calls.values())
            for served in calls:             # a gateway that went away: as on gRPC
                served.end()
        if self._conn.broken:
            log.info("a gateway's link ended: %s", self._conn.why)
        return b""

    def _frame(self, kind: int, call_id: int, body: bytes) -> None:
        if kind == CALL:
            self._start(call_id, pb.RunRequest.FromString(body))
            return
        if kind == HEALTH:
            self._answer_health(call_id)
            return
        with self._lock:
            served = self._calls.get(call_id)
        if served is None:
            return
        if kind == REQUEST:
            served.requests.put(pb.RunRequest.FromString(body))
        else:                                 # CANCEL
            served.end()

    def _send(self, kind: int, call_id: int, body: bytes = b"") -> None:
        self._conn.send(kind, call_id, body)

    def _answer_health(self, call_id: int) -> None:
        try:
            reply = self._health().SerializeToString()
        except Exception as exc:  # noqa: BLE001 - the gateway then asks on gRPC, told why
            log.exception("a health check on a gateway's link failed")
            self._send(ERROR, call_id, LaneError(grpc.StatusCode.INTERNAL, str(exc)).body())
            return
        self._send(HEALTH_REPLY, call_id, reply)

    def _start(self, call_id: int, request: pb.RunRequest) -> None:
        served = _Served()
        with self._lock:
            if call_id in self._calls:
                raise ConnectionError(f"call {call_id} started twice on the link")
            self._calls[call_id] = served
        try:
            threading.Thread(target=self._serve_call, args=(call_id, request, served),
                             daemon=True, name="link-call").start()
        except RuntimeError as exc:           # (no thread to be had): this call only fails
            with self._lock:
                self._calls.pop(call_id, None)
            self._send(ERROR, call_id, LaneError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot serve the call: {exc}").body())

    def _serve_call(self, call_id: int, request: pb.RunRequest, served: _Served) -> None:
        def send(kind: int, body: bytes = b"") -> None:
            self._send(kind, call_id, body)
        requests = itertools.chain((request,), iter(served.requests.get, None))
        try:
            if not serve_call(self._run(requests, served.context), served.context, send):
                self._conn.shut()            # broken: serve() ends the others
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
            served.end()
