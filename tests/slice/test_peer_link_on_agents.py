"""A gateway's links to its peers (agent/wire/peer_link.py) between real
agents: cold calls on one link per peer, failures, cuts, restarts, peers
without a data port or with full lanes, a link gone silent, a stuck peer.
The link's two ends on their own: tests/unit/test_peer_link.py."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time

import psutil
import pytest

import remote_tpu
from conftest import Agents, dropping, need_iptables, wait_until
from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.limits import INLINE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.wire import peer_link as _peer_link

pytestmark = pytest.mark.timeout(120)


def _links(agents, peer: int) -> int:
    """Connections the gateway holds to a peer's data port."""
    gateway = psutil.Process(agents.procs[0].pid)
    return sum(1 for c in gateway.net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.raddr and
               c.raddr.port == agents.data_ports[peer])


def _on(agents, **kw):
    kw.setdefault("stream", "none")
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, init_jax=False, **kw)


def _where(text: str = ""):
    import os
    import sys

    print(f"{text} from {os.environ['REMOTE_TPU_PROCESS_INDEX']}", flush=True)
    print(f"err {text}", file=sys.stderr, flush=True)
    return int(os.environ["REMOTE_TPU_PROCESS_INDEX"]), os.getpid()


@pytest.mark.slow
def test_cold_calls_go_on_one_link_per_peer_with_their_output(agents, capfd):
    fn = _on(agents, stream="all")(_where)
    for i in range(3):
        assert fn(f"call{i}")[0] == 0
        out = capfd.readouterr()
        assert f"call{i} from 1" in out.out and f"err call{i}" in out.err
    assert _links(agents, 1) == 1                           # one link, kept, for all three
    two = _on(agents, processes_per_host=2)(lambda: 1)
    assert two() == 1
    assert _links(agents, 1) == 1                           # both processes on it


@pytest.mark.slow
def test_a_failure_on_the_peer_names_it_whatever_the_payloads_size(agents):
    @_on(agents)
    def fail(big: bytes):
        import os
        if os.environ["REMOTE_TPU_PROCESS_INDEX"] == "1":
            raise ValueError(f"peer says no to {len(big)} bytes")
        return len(big)

    for big in (b"", b"y" * (200 << 10), b"z" * (INLINE_BYTES + 1)):   # (the middle one is
        # sent from a thread of its own, on the link; the last one on gRPC)
        with pytest.raises(ValueError, match=f"peer says no to {len(big)} bytes") as info:
            fail(big)
        assert "host 1" in str(info.value) + "\n".join(getattr(info.value, "__notes__", []))


@pytest.mark.slow
def test_a_link_cut_during_a_call_fails_it_naming_the_peer_and_the_next_call_works(agents):
    if shutil.which("ss") is None:
        pytest.skip("no ss here (iproute2) to cut a TCP connection")

    @_on(agents)
    def nap(seconds: float):
        import time

        time.sleep(seconds)
        return 1

    assert nap(0) == 1
    assert _links(agents, 1) == 1

    def cut():
        subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=",
                        str(agents.data_ports[1])], capture_output=True)
    cutter = threading.Timer(1.0, cut)
    cutter.start()
    start = time.monotonic()
    try:
        with pytest.raises(remote_tpu.JobFailedError) as info:
            nap(30)
    finally:
        cutter.join()
    if _links(agents, 1) and time.monotonic() - start > 25:
        pytest.skip("cannot cut a TCP connection here (ss -K)")
    text = str(info.value)
    assert "host 1" in text and "link" in text, text
    assert time.monotonic() - start < 15                    # fail-fast, not the sleep
    assert nap(0) == 1                                      # on a new link
    assert _links(agents, 1) == 1
    assert wait_until(lambda: not [p for p in psutil.Process(agents.procs[1].pid).children()
                                   if p.name() == "rtpu-worker" and p.status() != "zombie"
                                   and "nap" in " ".join(p.cmdline())], timeout=5)


@pytest.mark.slow
def test_a_peer_agent_that_restarts_gets_a_new_link():
    agents = Agents(2)
    try:
        fn = _on(agents)(lambda: 7)
        assert fn() == 7 and _links(agents, 1) == 1
        agents.procs[1].send_signal(signal.SIGKILL)
        agents.restart(1)
        assert wait_until(lambda: _links(agents, 1) == 0, timeout=10)   # its end closed
        assert fn() == 7
        assert _links(agents, 1) == 1
    finally:
        agents.stop()


@pytest.mark.slow
def test_a_peer_without_a_data_port_takes_its_calls_on_gRPC():
    agents = Agents(2, extra=["--data-port", "-1"])
    try:
        assert _on(agents)(_where)()[0] == 0
        assert _on(agents)(_where)()[0] == 0
    finally:
        agents.stop()


@pytest.mark.slow
def test_a_peer_whose_lanes_are_full_takes_its_calls_on_gRPC():
    from remote_tpu_agent.wire.data_port import MAX_LANES
    agents = Agents(2)
    held = []
    try:
        creds = Credentials(token=agents.token)
        for _ in range(MAX_LANES):                   # every lane of peer 1 taken
            ticket = stub(agents.addresses[1], creds).OpenLink(
                pb.LinkRequest(), timeout=30, metadata=creds.metadata)
            held.append(_peer_link.connect(agents.addresses[1], ticket, 10))
        fn = _on(agents)(_where)
        for _ in range(4):
            assert fn()[0] == 0
        assert _links(agents, 1) == 0                    # refused at once, not half-open
    finally:
        for sock in held:
            sock.close()
        agents.stop()


@pytest.mark.slow
def test_a_link_that_goes_silent_is_closed_and_the_call_goes_on_gRPC():
    """The network drops the link (not gRPC): the check before the call gets
    no answer on it, so the link is closed and the peer asked on gRPC, which
    answers: the call runs there, and so do the next ones (no new link can be
    opened)."""
    need_iptables()
    agents = Agents(2)
    try:
        fn = _on(agents)(_where)
        assert fn()[0] == 0 and _links(agents, 1) == 1
        with dropping(agents.data_ports[1]):
            start = time.monotonic()
            assert fn()[0] == 0                          # on gRPC
            assert time.monotonic() - start < 15
            assert _links(agents, 1) == 0
            assert fn()[0] == 0
        assert fn()[0] == 0
    finally:
        agents.stop()


@pytest.mark.slow
def test_a_stuck_peer_is_refused_within_7_s_naming_it_and_served_once_it_goes_on():
    agents = Agents(2)
    try:
        fn = _on(agents)(_where)
        assert fn()[0] == 0 and _links(agents, 1) == 1
        agents.procs[1].send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(remote_tpu.JobFailedError) as info:
                fn()
            assert time.monotonic() - start < 10       # 5 s on the link, 2 on gRPC
        finally:
            agents.procs[1].send_signal(signal.SIGCONT)
        text = str(info.value)
        assert f"agent at {agents.addresses[1]} cannot take the job" in text, text
        assert "nothing was started" in text, text
        assert fn()[0] == 0                              # (on a new link)
        assert wait_until(lambda: _links(agents, 1) == 1, timeout=5)
    finally:
        agents.stop()
