"""A warm session's lane (agent/wire/peer_lane.py): its calls and their events on one
plain TCP connection between the gateway and each peer, opened with a ticket of
the peer's data port. The module on a real data port; between real agents:
tests/slice/test_lane_on_agents.py."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from remote_tpu._core.limits import INLINE_BYTES, MAX_MESSAGE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu._core.data_wire import send_frame
from remote_tpu_agent.wire.peer_lane import CALL, GatewayLane, PeerLane

from conftest import wait_until

pytestmark = pytest.mark.timeout(120)

_CANCEL = pb.RunRequest(control=pb.CONTROL_CANCEL)


class _Pair:
    """A peer's lane offered on a real data port, and the gateway's end of it."""

    def __init__(self) -> None:
        self.port = DataPort("127.0.0.1")
        self.calls: queue.Queue = queue.Queue()
        self.cancels: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.ends: queue.Queue = queue.Queue()
        self.peer = PeerLane(self.calls.put, lambda: self.cancels.put(True))
        self.ticket = self.peer.offer(self.port)
        self.gateway = GatewayLane.connect(f"127.0.0.1:{self.port.port}", self.ticket,
                                           self.events.put, self.ends.put, "test-lane")
        assert self.gateway is not None
        assert wait_until(lambda: self.peer.open, timeout=5)

    def close(self) -> None:
        self.gateway.close()
        self.peer.close()
        self.port.close()


@pytest.fixture
def pair():
    p = _Pair()
    yield p
    p.close()


def test_calls_cancels_and_events_cross_the_lane(pair):
    spec = pb.JobSpec(job_id="j-2", payload=b"\x00" * INLINE_BYTES, payload_size=INLINE_BYTES)
    assert pair.gateway.send(pb.RunRequest(next_call=spec))
    got = pair.calls.get(timeout=5)
    assert got.job_id == "j-2" and got.payload == spec.payload        # a whole MiB, intact
    assert pair.gateway.send(pb.RunRequest(next_call=pb.JobSpec(job_id="j-3")))
    assert pair.calls.get(timeout=5).payload == b""                   # and 0 bytes
    assert pair.gateway.send(_CANCEL)
    assert pair.cancels.get(timeout=5)
    assert not pair.gateway.send(pb.RunRequest(control=pb.CONTROL_RELEASE))   # not a lane's
    for data in (b"", b"x", b"y" * (1 << 20)):
        assert pair.peer.send(pb.Event(host=1, output=pb.Output(data=data)))
    assert [pair.events.get(timeout=5).output.data for _ in range(3)] == \
        [b"", b"x", b"y" * (1 << 20)]                                # in order


def test_the_gateway_closing_its_end_ends_the_peers_quietly(pair):
    pair.gateway.close()
    assert pair.ends.get(timeout=5) == ""              # ours: no complaint
    assert wait_until(lambda: not pair.peer.open, timeout=5)
    assert not pair.peer.send(pb.Event(host=1))


def test_the_peer_closing_its_end_is_said_to_the_gateway(pair):
    assert pair.peer.send(pb.Event(host=1, exited=pb.HostReport(host=1)))
    pair.peer.close()
    assert pair.events.get(timeout=5).HasField("exited")      # what came first still comes
    assert pair.ends.get(timeout=5) == "the peer closed the lane"
    assert not pair.gateway.send(_CANCEL)


@pytest.mark.parametrize("frame", [
    (MAX_MESSAGE_BYTES + 2).to_bytes(4, "big"),          # one past the largest frame
    (0).to_bytes(4, "big"),                              # no kind
    (1).to_bytes(4, "big") + bytes((CALL,)),             # a kind the peer never sends
])
def test_a_frame_the_gateway_cannot_take_breaks_the_lane_and_says_why(pair, frame):
    pair.peer._sock.sendall(frame)
    why = pair.ends.get(timeout=5)
    assert why.startswith("the lane broke: ") and ("bytes" in why or "kind" in why)


def test_an_undecodable_call_ends_the_peers_end(pair):
    send_frame(pair.gateway._sock, CALL, b"\xff\xff\xff")
    assert pair.ends.get(timeout=5) == "the peer closed the lane"
    assert pair.calls.empty()


def test_a_lane_with_a_wrong_ticket_or_nonce_is_not_opened():
    port = DataPort("127.0.0.1")
    try:
        peer = PeerLane(lambda spec: None, lambda: None)
        ticket = peer.offer(port)
        wrong = pb.DataTicket(port=ticket.port, nonce=ticket.nonce, ticket=b"\x00" * 32)
        assert GatewayLane.connect(f"127.0.0.1:{port.port}", wrong, print, print, "t") \
            is not None                                  # connected, but let in by nothing:
        assert not wait_until(lambda: peer.open, timeout=1)
        stranger = pb.DataTicket(port=ticket.port, nonce=b"\x01" * 16, ticket=ticket.ticket)
        assert GatewayLane.connect(f"127.0.0.1:{port.port}", stranger, print, print,
                                   "t") is None          # not that agent: nothing sent
        assert not peer.open
    finally:
        port.close()


@pytest.mark.parametrize("side", ["peer", "gateway"])
def test_closing_an_end_whose_send_is_stuck_returns_at_once(side):
    """The other end stops reading, and a send blocks on the full socket:
    close() (as a gRPC callback of a call that ended calls it) must not wait
    for that send, and the send then fails."""
    port = DataPort("127.0.0.1")
    stuck = threading.Event()
    try:
        peer = PeerLane(lambda spec: stuck.wait(), lambda: None)       # reads nothing more
        ticket = peer.offer(port)
        gateway = GatewayLane.connect(f"127.0.0.1:{port.port}", ticket,
                                      lambda event: stuck.wait(), lambda why: None, "t")
        assert wait_until(lambda: peer.open, timeout=5)
        if side == "peer":
            sender, closer = (lambda: peer.send(pb.Event(output=pb.Output(
                data=b"x" * (1 << 20))))), peer.close
        else:
            request = pb.RunRequest(next_call=pb.JobSpec(payload=b"x" * (1 << 20)))
            sender, closer = (lambda: gateway.send(request)), gateway.close
        results: list[bool] = []

        def send_until_stuck():
            while True:
                ok = sender()
                results.append(ok)
                if not ok:
                    return
        thread = threading.Thread(target=send_until_stuck, daemon=True)
        thread.start()
        time.sleep(1.5)                       # (the socket's buffers are full by now)
        assert thread.is_alive()
        start = time.monotonic()
        closer()
        assert time.monotonic() - start < 1
        thread.join(5)
        assert not thread.is_alive() and results[-1] is False
    finally:
        stuck.set()
        port.close()


def test_no_data_port_no_lane():
    assert PeerLane(lambda spec: None, lambda: None).offer(None) is None

