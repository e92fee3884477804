"""A gateway's link to a peer (agent/wire/peer_link.py): the peers' parts of cold
calls on one plain TCP connection per peer, opened with a ticket of the peer's
data port. Both ends on a real data port; between real agents:
tests/slice/test_peer_link_on_agents.py."""

from __future__ import annotations

import queue
import time

import grpc
import pytest

from remote_tpu._core.data_wire import send_frame
from remote_tpu._core.limits import INLINE_BYTES, MAX_MESSAGE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.wire import peer_link as _peer_link
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu_agent.wire.peer_link import CALL, GatewayLink
from remote_tpu_agent.wire.peer_link_server import PeerLink, offer_link

pytestmark = pytest.mark.timeout(120)


class _Peer:
    """A peer's end on a real data port whose calls echo what they are sent:
    each request's spec or control comes back as an output event, until the
    gateway ends the call (or a request asks for an end, a refusal, a crash)."""

    def __init__(self) -> None:
        self.port = DataPort("127.0.0.1")
        self.ended: queue.Queue = queue.Queue()       # job ids whose context ended

    def run(self, requests, context):
        first = next(requests)
        job = first.spec.job_id
        context.add_callback(lambda: self.ended.put(job))
        if job == "refuse":
            context.set_trailing_metadata((("remote-tpu-error", "busy"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "host busy")
        if job == "crash":
            raise RuntimeError("a bug on the peer")
        yield pb.Event(host=1, output=pb.Output(data=first.spec.payload))
        for request in requests:
            if request.control == pb.CONTROL_RELEASE:
                yield pb.Event(host=1, exited=pb.HostReport(host=1, detail=job))
                return
            yield pb.Event(host=1, output=pb.Output(data=f"control {request.control}".encode()))

    def link(self, silence: float = 10.0) -> GatewayLink:
        return self.link_with(lambda: pb.HealthReply(tpu_busy="busy?"), silence)

    def link_with(self, health, silence: float = 10.0) -> GatewayLink:
        ticket = offer_link(self.port, self.run, health)
        address = f"127.0.0.1:{self.port.port}"
        return GatewayLink(address, _peer_link.connect(address, ticket, 5), silence)


def _health(link: GatewayLink, timeout: float):
    """The peer's health asked on ``link`` (None: closed, broken, unanswerable)."""
    wait = link.ask_health()
    return wait(timeout) if wait is not None else None


class _Call:
    def __init__(self, link: GatewayLink, job: str, payload: bytes = b"") -> None:
        self.events: queue.Queue = queue.Queue()
        self.ends: queue.Queue = queue.Queue()
        request = pb.RunRequest(spec=pb.JobSpec(job_id=job, payload=payload))
        self.call = link.call(request, self.events.put, self.ends.put)

    def data(self) -> bytes:
        return self.events.get(timeout=5).output.data


@pytest.fixture
def peer():
    p = _Peer()
    yield p
    p.port.close()


def test_calls_on_one_link_each_get_their_own_events_and_end(peer):
    link = peer.link()
    a, b = _Call(link, "a", b"\x00" * INLINE_BYTES), _Call(link, "b", b"")
    assert a.data() == b"\x00" * INLINE_BYTES and b.data() == b""    # a whole MiB; 0 bytes
    assert b.call.send(pb.RunRequest(control=pb.CONTROL_CANCEL))
    assert b.data() == b"control 2" and a.events.empty()
    for call, job in ((a, "a"), (b, "b")):
        assert call.call.send(pb.RunRequest(control=pb.CONTROL_RELEASE))
        assert call.events.get(timeout=5).exited.detail == job
        assert call.ends.get(timeout=5) is None                     # ended by the peer
    assert {peer.ended.get(timeout=5), peer.ended.get(timeout=5)} == {"a", "b"}
    assert not link.closed                                           # and stays open
    c = _Call(link, "c", b"x")
    assert c.data() == b"x"
    link.close()


def test_health_is_answered_on_the_link_between_and_beside_calls(peer):
    link = peer.link()
    assert _health(link, 5).tpu_busy == "busy?"
    call = _Call(link, "a", b"x")
    assert call.data() == b"x"
    assert [_health(link, 5).tpu_busy for _ in range(3)] == ["busy?"] * 3
    link.close()
    assert _health(link, 5) is None                          # closed: ask on gRPC


def test_health_checks_asked_together_are_each_answered(peer):
    links = [peer.link() for _ in range(3)]
    waits = [link.ask_health() for link in links for _ in range(2)]
    assert [wait(5).tpu_busy for wait in reversed(waits)] == ["busy?"] * 6
    links[0].close()
    assert links[0].ask_health() is None
    wait = links[1].ask_health()
    links[1].close()                                       # broken before it is answered:
    assert wait(5) is None or wait(5).tpu_busy == "busy?"  # none, at once (or it came first)
    links[2].close()


def test_health_unanswered_in_time_is_none(peer):
    link = peer.link_with(lambda: time.sleep(2) or pb.HealthReply())
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 0.3 s"):
        _health(link, 0.3)
    assert time.monotonic() - start < 1.5
    link.close()


def test_a_health_check_the_peer_cannot_answer_is_none_and_the_link_goes_on(peer):
    def broken():
        raise OSError("no /proc here")
    link = peer.link_with(broken)
    assert _health(link, 5) is None                          # (the gateway asks on gRPC)
    call = _Call(link, "a", b"x")
    assert call.data() == b"x"
    link.close()


def test_cancelling_a_call_ends_it_on_the_peer_at_once_and_says_so_here(peer):
    link = peer.link()
    call = _Call(link, "a")
    assert call.data() == b""
    call.call.cancel()
    error = call.ends.get(timeout=5)
    assert error.code() == grpc.StatusCode.CANCELLED
    assert peer.ended.get(timeout=5) == "a"                 # its worker is stopped there
    assert not call.call.send(pb.RunRequest(control=pb.CONTROL_RELEASE))
    call.call.cancel()                                       # twice: nothing more
    assert call.ends.empty()
    other = _Call(link, "b")                                 # the link goes on
    assert other.data() == b""
    link.close()


def test_a_refused_call_ends_with_the_peers_words_and_a_crash_as_internal(peer):
    link = peer.link()
    refused, crashed = _Call(link, "refuse"), _Call(link, "crash")
    error = refused.ends.get(timeout=5)
    assert (error.code(), error.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "host busy")
    assert dict(error.trailing_metadata()) == {"remote-tpu-error": "busy"}
    error = crashed.ends.get(timeout=5)
    assert error.code() == grpc.StatusCode.INTERNAL and "a bug on the peer" in error.details()
    assert _Call(link, "after").data() == b""
    link.close()


def test_the_gateway_going_away_ends_every_call_on_the_peer(peer):
    link = peer.link()
    calls = [_Call(link, job) for job in ("a", "b", "c")]
    for call in calls:
        assert call.data() == b""
    link.close()
    assert {peer.ended.get(timeout=5) for _ in calls} == {"a", "b", "c"}
    assert link.call(pb.RunRequest(), print, print) is None      # a closed link takes none


@pytest.mark.parametrize("frame", [
    (MAX_MESSAGE_BYTES + 2).to_bytes(4, "big"),          # one past the largest frame
    (1).to_bytes(4, "big") + bytes((_peer_link.EVENT,)),   # no call id
    (5).to_bytes(4, "big") + bytes((CALL,)) + (1).to_bytes(4, "big"),   # a kind never sent
    (8).to_bytes(4, "big") + bytes((_peer_link.EVENT,)) + (1).to_bytes(4, "big")
    + b"\xff\xff\xff",                                   # an event that cannot be read
])
def test_a_broken_link_fails_every_call_on_it_naming_why(peer, frame):
    link = peer.link()
    calls = [_Call(link, job) for job in ("a", "b")]
    for call in calls:
        assert call.data() == b""
    _peer_side_send(link, frame)
    for call in calls:
        error = call.ends.get(timeout=5)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details().startswith(
            "the link broke: ") and "during the call" in error.details(), error.details()
    assert link.closed


def _peer_side_send(link: GatewayLink, frame: bytes) -> None:
    """Write raw bytes to the gateway's end, as a broken peer would, on the
    peer's socket of that connection."""
    ours = link._sock.getsockname()
    for conn in _PEER_SOCKETS:
        if conn.getpeername() == ours:
            conn.sendall(frame)
            return
    raise AssertionError("the peer's end of the link was not found")


_PEER_SOCKETS: list = []


@pytest.fixture(autouse=True)
def _remember_peer_sockets(monkeypatch):
    serve = PeerLink.serve

    def remembering(self, sock):
        _PEER_SOCKETS.append(sock)
        return serve(self, sock)
    monkeypatch.setattr(PeerLink, "serve", remembering)
    yield
    _PEER_SOCKETS.clear()


def test_a_health_answer_that_cannot_be_read_is_none(peer):
    link = peer.link_with(lambda: time.sleep(1) or pb.HealthReply(tpu_busy="late"))
    wait = link.ask_health()                              # (the link's first id: 1)
    _peer_side_send(link, (8).to_bytes(4, "big") + bytes((_peer_link.HEALTH_REPLY,))
                    + (1).to_bytes(4, "big") + b"\xff\xff\xff")
    assert wait(5) is None                                # (the gateway asks on gRPC)
    assert _health(link, 5).tpu_busy == "late"              # and the link goes on
    link.close()


def test_a_frame_the_peer_cannot_take_ends_the_link_and_its_calls(peer):
    link = peer.link()
    call = _Call(link, "a")
    assert call.data() == b""
    send_frame(link._sock, _peer_link.REQUEST, b"\x00")          # no call id
    assert call.ends.get(timeout=5).code() == grpc.StatusCode.UNAVAILABLE
    assert peer.ended.get(timeout=5) == "a"


def test_no_data_port_no_link():
    assert offer_link(None, lambda requests, context: iter(()), pb.HealthReply).port == 0

