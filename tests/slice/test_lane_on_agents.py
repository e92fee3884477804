"""A warm session's lane (agent/wire/caller_lane.py) between real agents:
warm calls, their output and large payloads go on it; a lane cut between or
during calls, or black-holed. The lane's two ends on their own:
tests/unit/test_lane.py."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import psutil
import pytest

import remote_tpu
from conftest import dropping, need_iptables, wait_until
from remote_tpu._core.limits import INLINE_BYTES

pytestmark = pytest.mark.timeout(120)


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

    def named_workers() -> list[psutil.Process]:
        """(A worker names itself rtpu-worker once it has its call.)"""
        return [p for a in slice_.procs for p in psutil.Process(a.pid).children()
                if p.name() == "rtpu-worker"]
    assert wait_until(lambda: len(named_workers()) == 2, timeout=10)
    workers = named_workers()
    with dropping(slice_.data_ports[1]):
        start = time.monotonic()
        threading.Thread(target=handle.cancel, daemon=True).start()   # (waits for the end)
        assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                          for p in workers), timeout=15)
        assert time.monotonic() - start < 2
