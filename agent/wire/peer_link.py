"""A gateway's link to each of its peers: the peers' parts of cold calls on one
plain TCP connection per peer, instead of a gRPC ``Run`` call each.

A cold call's ``Run`` to a peer costs the gateway Python gRPC's machinery
(two threads of its own per call, and every message handled in Python), once
per peer: the gateway's largest cost on a slice of many hosts, and about as
much again spread over the peers. A frame on a socket costs a small part of
that. Figures: benchmarks/README.md.

The gateway's end is here; the peer's is ``wire.peer_link_server``.

How it opens: the gateway asks the peer for a ticket of its data port
(``OpenLink``, where the token was checked) and connects with it; the link then
stays open for as long as both agents live, and carries every later cold call
of this gateway to that peer, several at once (``processes_per_host``).

Frames: numbered, on the one connection kind of every side channel
(``remote_tpu._core.frame_connection``); the gateway numbers the calls.

- gateway -> peer: ``CALL`` (the call's first request: its spec, with the
  payload inside), ``REQUEST`` (each next request: release, cancel), ``CANCEL``
  (the call ends, as a gRPC call the gateway cancels: the worker is stopped);
- peer -> gateway: ``EVENT``, then ``END``, or ``ERROR`` (what the call was
  refused with, as a caller's lane says it);
- and ``HEALTH``, answered with ``HEALTH_REPLY``: the gateway's check before a
  call (``RemoteHost.preflight``), which cost a gRPC ``Health`` call per peer.

What goes on gRPC as before: a call whose payload is not inline, a warm
session's calls (their ``Run`` call is the session's lifeline, and their own
lane carries the next ones: ``wire.peer_lane``), and every call to a peer without a data
port (TLS, ``--data-port -1``) or whose link cannot be opened. A link that
breaks fails the calls on it as a broken gRPC connection does (the peer is
lost); the next call opens a new one. Each end counts the other's host as
gone (or the network to it cut) after ``SILENCE_SECONDS`` of silence
(``data_wire.keep_alive``; the gateway's ``--peer-timeout`` where it has one).
A peer agent that is there but stuck (stopped, say) is answered for by its
kernel, as on gRPC: only the call's own ``timeout=`` ends that. A health check
the peer does not answer in time refuses the call, as on gRPC, and closes the
link (the next call opens a new one, or goes on gRPC if it cannot).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

import grpc

from remote_tpu._core import data_wire
from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.data_wire import LaneError
from remote_tpu._core.frame_connection import FrameConnection, OverFrames
from remote_tpu._core.proto import remote_tpu_pb2 as pb


log = logging.getLogger(__name__)

CALL, CANCEL, EVENT, END, ERROR = (data_wire.CALL, data_wire.CANCEL, data_wire.EVENT,
                                   data_wire.END, data_wire.ERROR)   # (protos/: FrameKind)
REQUEST, HEALTH, HEALTH_REPLY, LINKED = (data_wire.REQUEST, data_wire.HEALTH,
                                         data_wire.HEALTH_REPLY, data_wire.LINKED)

SILENCE_SECONDS = 10.0
RETRY_SECONDS = 60.0          # a peer whose link could not be opened: gRPC until then
# (doubling while it keeps failing, up to data_wire.RETRY_MAX: data_wire.Backoff)

# ---------------------------------------------------------------- the gateway's end

class LinkCall:
    """One call on a link, as the gateway sees it: ``on_event`` gets its
    events and ``on_end`` its end, once (None: the peer ended it; else the
    error, as gRPC would raise it), both on the link's reader thread, or on
    the thread that cancels it."""

    def __init__(self, link: GatewayLink, call_id: int,
                 on_event: Callable[[pb.Event], None],
                 on_end: Callable[[grpc.RpcError | None], None]) -> None:
        self._link = link
        self.id = call_id
        self.on_event = on_event
        self._on_end = on_end
        self._lock = threading.Lock()
        self._ended = False

    def send(self, request: pb.RunRequest) -> bool:
        return not self._ended and self._link.send(REQUEST, self.id, request.SerializeToString())

    def close(self) -> None:
        """No more requests: a call on a link has no half-close (its end comes
        from the peer, or from ``cancel``)."""

    def cancel(self) -> None:
        """End the call (the peer stops its worker), as gRPC's ``cancel`` does."""
        if self.finish(LaneError(grpc.StatusCode.CANCELLED, "the gateway ended the call")):
            self._link.send(CANCEL, self.id)

    def claim(self) -> bool:
        """Mark it ended without a word (it never started); False if it had."""
        with self._lock:
            ended, self._ended = self._ended, True
        return not ended

    def finish(self, error: grpc.RpcError | None) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._ended = True
        self._link.forget(self.id)
        self._on_end(error)
        return True


class _Answer:
    __slots__ = ("body", "came")

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.came = threading.Event()


class GatewayLink(OverFrames):
    """The gateway's end of one peer's link."""

    def __init__(self, address: str, sock: socket.socket, silence: float) -> None:
        self.address = address
        self._conn = FrameConnection(sock, (EVENT, END, ERROR, HEALTH_REPLY), what="link",
                                     silence=silence, closed_why="the link closed")
        self._lock = threading.Lock()
        self._calls: dict[int, LinkCall] = {}
        self._asked: dict[int, _Answer] = {}     # health checks, by call id
        threading.Thread(target=self._read, daemon=True, name=f"link-{address}").start()

    def call(self, request: pb.RunRequest, on_event: Callable[[pb.Event], None],
             on_end: Callable[[grpc.RpcError | None], None]) -> LinkCall | None:
        """Start a call with its first request; None when the link cannot take
        it (the peer got none of it: send it with gRPC)."""
        with self._lock:
            if self.closed:
                return None
            call = LinkCall(self, self._conn.new_id(), on_event, on_end)
            self._calls[call.id] = call
        if self.send(CALL, call.id, request.SerializeToString()) or not call.claim():
            return call            # (not claimed: the link broke and ended it, as lost)
        self.forget(call.id)
        return None

    def ask_health(self) -> Callable[[float], pb.HealthReply | None] | None:
        """Ask the peer's ``Health`` on the link (None: it is closed); returns
        a function that waits at most its argument's seconds for the answer:
        None when the link broke or the peer could not answer (ask it on gRPC),
        TimeoutError when no answer came in time."""
        answer = _Answer()
        with self._lock:
            if self.closed:
                return None
            call_id = self._conn.new_id()
            self._asked[call_id] = answer
        if not self.send(HEALTH, call_id):
            self._unask(call_id)
            return None

        def wait(timeout: float) -> pb.HealthReply | None:
            came = answer.came.wait(timeout)
            self._unask(call_id)
            if not came:
                raise TimeoutError(f"no answer within {timeout:.3g} s on the gateway's "
                                   "link to it")
            try:
                return None if answer.body is None else pb.HealthReply.FromString(answer.body)
            except data_wire.FRAME_ERRORS:          # (what the peer sent cannot be read)
                return None
        return wait

    def _unask(self, call_id: int) -> None:
        with self._lock:
            self._asked.pop(call_id, None)

    def send(self, kind: int, call_id: int, body: bytes = b"") -> bool:
        if self._conn.try_send(kind, call_id, body):
            return True
        self._conn.shut()                    # the reader ends the calls on it
        return False

    def forget(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        self._conn.close()

    def _frame(self, kind: int, call_id: int, body: bytes) -> None:
        with self._lock:
            call = self._calls.get(call_id)
            asked = self._asked.get(call_id)
        if asked is not None:         # (ERROR: it could not answer)
            asked.body = body if kind == HEALTH_REPLY else None
            asked.came.set()
            return
        if call is None:
            return                    # a call that ended here: what it still sent
        if kind == EVENT:
            call.on_event(pb.Event.FromString(body))
        elif kind == END:
            call.finish(None)
        else:
            call.finish(LaneError.from_body(body))

    def _read(self) -> None:
        why = "the link closed"
        try:
            why = self._conn.serve(self._frame)
        finally:
            _forget(self)
            with self._lock:
                calls, self._calls = list(self._calls.values()), {}
                for asked in self._asked.values():
                    asked.came.set()          # (no body: none came)
            for call in calls:
                call.finish(LaneError(grpc.StatusCode.UNAVAILABLE, f"{why} during the call"))


_links: dict[str, GatewayLink] = {}
_opening: dict[str, threading.Lock] = {}
_unopened = data_wire.Backoff(RETRY_SECONDS, data_wire.RETRY_MAX)   # links that failed to open
_lock = threading.Lock()


def existing(address: str) -> GatewayLink | None:
    """This gateway's open link to ``address``, if it has one."""
    link = _links.get(address)
    return link if link is not None and not link.closed else None


def link_to(address: str, credentials: Credentials) -> GatewayLink | None:
    """The link to the agent at ``address``, opened if need be; None when it
    has none to offer or cannot be reached on its data port (tried again after
    ``RETRY_SECONDS``, doubling while it keeps failing: ``data_wire.Backoff``)."""
    if (link := existing(address)) is not None:
        return link
    if not data_wire.worth_trying(address, credentials) or not _unopened.usable(address):
        return None
    with _lock:
        opening = _opening.setdefault(address, threading.Lock())
    with opening:
        if (link := existing(address)) is not None:
            return link
        link = _open(address, credentials)
        with _lock:
            if link is None:
                _unopened.failed(address)
            else:
                _unopened.worked(address)
                _links[address] = link
        return link


def _open(address: str, credentials: Credentials) -> GatewayLink | None:
    try:
        ticket = stub(address, credentials).OpenLink(
            pb.LinkRequest(), timeout=credentials.answer_within(5),
            metadata=credentials.metadata)
        if not ticket.port:
            return None
        sock = connect(address, ticket, credentials.answer_within(5))
    except grpc.RpcError as exc:
        log.info("no link to %s (its calls go on gRPC): %s", address, exc.details())
        return None
    except (data_wire.Unreachable, OSError) as exc:
        log.info("no link to %s (its calls go on gRPC): %s", address, exc)
        return None
    return GatewayLink(address, sock, credentials.keepalive or SILENCE_SECONDS)


def connect(address: str, ticket: pb.DataTicket, within: float) -> socket.socket:
    """A link's connection, the peer's data port let in by ``ticket``, once
    the peer says it serves it (within ``within`` seconds; it refuses one
    when its lanes are full). OSError, data_wire.Unreachable."""
    sock = data_wire.open_lane(address, ticket)
    try:
        sock.settimeout(within)
        frame = data_wire.read_frame(sock)
        if frame is None or frame[0] != LINKED:
            raise ConnectionError("the agent did not take the link (its lanes are full?)")
        return sock
    except data_wire.FRAME_ERRORS as exc:
        sock.close()
        raise ConnectionError(str(exc)) from None


def _forget(link: GatewayLink) -> None:
    with _lock:
        if _links.get(link.address) is link:
            del _links[link.address]
