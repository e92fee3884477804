"""A warm session's lane (agent/wire/peer_lane.py): its calls and their events on one
plain TCP connection between the gateway and each peer, opened with a ticket of
the peer's data port. The module on a real data port; then two real agents."""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time

import psutil
import pytest

import remote_tpu
from remote_tpu._core.limits import INLINE_BYTES, MAX_MESSAGE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu._core.data_wire import send_frame
from remote_tpu_agent.wire.peer_lane import CALL, CANCEL, GatewayLane, PeerLane

from conftest import dropping, need_iptables, wait_until

pytestmark = pytest.mark.timeout(120)


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
    assert pair.gateway.send(CALL, spec.SerializeToString())
    got = pair.calls.get(timeout=5)
    assert got.job_id == "j-2" and got.payload == spec.payload        # a whole MiB, intact
    assert pair.gateway.send(CALL, pb.JobSpec(job_id="j-3").SerializeToString())
    assert pair.calls.get(timeout=5).payload == b""                   # and 0 bytes
    assert pair.gateway.send(CANCEL)
    assert pair.cancels.get(timeout=5)
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
    assert not pair.gateway.send(CANCEL)


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
            body = pb.JobSpec(payload=b"x" * (1 << 20)).SerializeToString()
            sender, closer = (lambda: gateway.send(CALL, body)), gateway.close
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


# ---------------------------------------------------------------- real agents


@pytest.fixture
def slice_(agents):
    yield agents
    remote_tpu.release(hosts=agents.addresses[0], token=agents.token)


def _on(agents, **kw):
    kw.setdefault("stream", "none")
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, keep_warm=60, **kw)


def _lane_open(agents) -> bool:
    """The gateway holds a connection to its peer's data port: the lane."""
    gateway = psutil.Process(agents.procs[0].pid)
    return any(c.status == psutil.CONN_ESTABLISHED and c.raddr and
               c.raddr.port == agents.data_ports[1] for c in gateway.net_connections("tcp"))


def _count():
    import os

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    s = remote_tpu.state
    s["count"] = s.get("count", 0) + 1
    every = multihost_utils.process_allgather(jnp.array([s["count"], os.getpid()]))
    return {"counts": every[:, 0].tolist(), "pids": every[:, 1].tolist()}


def _cut_lane(agents) -> None:
    """Abort the lane's TCP connection from outside both agents, as a network would."""
    if shutil.which("ss") is None:
        pytest.skip("no ss here (iproute2) to cut a TCP connection")
    done = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=",
                           str(agents.data_ports[1])], capture_output=True, text=True)
    if done.returncode or _lane_still(agents):
        pytest.skip(f"cannot cut a TCP connection here (ss -K): {done.stderr.strip()}")


def _lane_still(agents) -> bool:
    return wait_until(lambda: not _lane_open(agents), timeout=2) is False


@pytest.mark.slow
def test_warm_calls_go_on_the_lane_with_their_output_and_large_payloads(slice_, capfd):
    step = _on(slice_, stream="all")(lambda text, big=b"": (
        print(f"host says {text} {len(big)}", flush=True), _count())[1])
    first = step("one")
    assert wait_until(lambda: _lane_open(slice_), timeout=10)
    second = step("two")
    large = step("three", b"z" * (INLINE_BYTES + 1))        # not inline: on gRPC, same workers
    fourth = step("four")
    assert [r["counts"] for r in (first, second, large, fourth)] == \
        [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert len({tuple(r["pids"]) for r in (first, second, large, fourth)}) == 1
    out = capfd.readouterr().out
    for text, size in (("one", 0), ("two", 0), ("three", INLINE_BYTES + 1), ("four", 0)):
        assert out.count(f"host says {text} {size}") == 2, out     # both hosts' lines


@pytest.mark.slow
def test_a_lane_cut_between_calls_costs_only_the_lane_and_is_offered_again(slice_):
    step = _on(slice_)(_count)
    pids = step()["pids"]
    for count in (2, 3):
        assert wait_until(lambda: _lane_open(slice_), timeout=10)
        _cut_lane(slice_)
        again = step()          # on gRPC: same workers, same state; then a new lane
        assert again["counts"] == [count, count] and again["pids"] == pids
    assert wait_until(lambda: _lane_open(slice_), timeout=10)
    assert step()["counts"] == [4, 4]


@pytest.mark.slow
def test_a_call_on_gRPC_that_fails_reports_its_host_as_it_ended_not_its_lane(slice_):
    """The call goes on gRPC (its payload is not inline) while the session has
    a lane; the peer ends that call, and with it the lane, as its worker dies:
    the host's own report says how, not a lane that closed."""
    @_on(slice_)
    def step(big: bytes, die: bool):
        import os

        import jax
        if die and jax.process_index() == 1:
            os._exit(3)
        return len(big)

    assert step(b"", False) == 0
    assert wait_until(lambda: _lane_open(slice_), timeout=10)
    for _ in range(3):
        with pytest.raises(remote_tpu.JobFailedError) as info:
            step(b"z" * (INLINE_BYTES + 1), True)
        text = str(info.value)
        assert "host 1: died (exited with code 3" in text and "lane" not in text, text
        assert step(b"", False) == 0                    # (a new session, with its lane)
        assert wait_until(lambda: _lane_open(slice_), timeout=10)


@pytest.mark.slow
def test_a_lane_cut_during_a_call_fails_it_naming_the_peer(slice_):
    @_on(slice_)
    def step(sleep: float):
        import time

        time.sleep(sleep)
        return 1

    assert step(0) == 1
    assert wait_until(lambda: _lane_open(slice_), timeout=10)
    cutter = threading.Timer(1.0, _cut_lane, (slice_,))
    cutter.start()
    start = time.monotonic()
    with pytest.raises(remote_tpu.JobFailedError) as info:
        step(30)
    cutter.join()
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "lane" in text and "warm workers were stopped" in text, text
    assert time.monotonic() - start < 15             # fail-fast, not the sleep
    assert step(0) == 1


@pytest.mark.slow
def test_a_call_cancelled_while_its_peers_lane_is_black_holed_stops_within_2_s(slice_):
    """The network drops the lane (not the gRPC call) during a call: cancelling
    it reaches the peer on gRPC too, at once, not after the lane gives up."""
    need_iptables()

    @_on(slice_, stream="all")
    def step(sleep: float):
        import os
        import time

        print(f"pid {os.getpid()}", flush=True)
        time.sleep(sleep)
        return 1

    assert step(0) == 1
    assert wait_until(lambda: _lane_open(slice_), timeout=10)
    handle = step.submit(60)                          # this caller's: on the lane
    assert wait_until(lambda: handle.status().state == "RUNNING", timeout=30)
    time.sleep(1)
    workers = [p for a in slice_.procs for p in psutil.Process(a.pid).children()
               if p.name() == "rtpu-worker"]
    assert len(workers) == 2
    with dropping(slice_.data_ports[1]):
        start = time.monotonic()
        threading.Thread(target=handle.cancel, daemon=True).start()   # (waits for the end)
        assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                          for p in workers), timeout=15)
        assert time.monotonic() - start < 2
