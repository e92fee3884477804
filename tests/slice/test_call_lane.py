"""A caller's lane (remote_tpu/_call_lane.py, agent/wire/caller_lane.py): a warm
session's next calls go to the gateway on one plain TCP connection of its data
port instead of RunInline. Two real agents, real callers."""

from __future__ import annotations

import os
import signal
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest

import remote_tpu
from remote_tpu import _call_lane as lane
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.wire import caller_lane as lane_server

from conftest import ROOT, dropping, need_iptables, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def slice_(agents):
    yield agents
    remote_tpu.release(hosts=agents.addresses[0], token=agents.token)


def _on(agents, **kw):
    kw.setdefault("stream", "none")
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, **kw)


def _lanes_to(agents, pid: int | None = None) -> int:
    """This process's (or ``pid``'s) connections to the gateway's data port."""
    proc = psutil.Process(pid or os.getpid())
    return sum(1 for c in proc.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED
               and c.raddr and c.raddr.port == agents.data_ports[0])


def _count():
    s = remote_tpu.state
    s["n"] = s.get("n", 0) + 1
    print(f"call {s['n']}", flush=True)
    return s["n"]


def test_a_warm_sessions_next_calls_go_on_one_lane_output_value_and_errors_alike(
        slice_, capfd):
    step = _on(slice_, keep_warm=60, stream="all")(_count)
    assert step() == 1
    assert _lanes_to(slice_) == 1                # offered by the first call's end
    assert [step() for _ in range(3)] == [2, 3, 4]
    assert _lanes_to(slice_) == 1                # the same one, each call
    out = capfd.readouterr().out
    assert all(out.count(f"call {n}") == 2 for n in range(1, 5)), out   # both hosts, live

    @_on(slice_, keep_warm=60)
    def fails():
        raise KeyError("on the lane")
    with pytest.raises(KeyError, match="on the lane") as info:
        fails()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on host" in notes and "warm workers were kept" in notes, notes
    assert step() == 5                           # the same workers, on the lane still
    assert _lanes_to(slice_) == 1


def test_a_call_without_keep_warm_gets_no_lane(slice_):
    assert _on(slice_)(lambda: 5)() == 5
    assert _lanes_to(slice_) == 0


def test_a_refused_call_raises_what_grpc_would_and_the_lane_goes_on(slice_):
    step = _on(slice_, keep_warm=60)(_count)
    step()
    key = next(iter(lane._lanes))
    bad = pb.RunRequest(spec=pb.JobSpec(job_id="no/such id", role=pb.ROLE_GATEWAY))
    with pytest.raises(lane.LaneError) as info:
        lane.start(key[0], key[1], bad)
    assert info.value.code() is not None and info.value.details()
    assert key in lane._lanes                           # the refusal was its answer
    assert step() == 2 and _lanes_to(slice_) == 1       # and the next call goes on it


def test_a_lane_cut_between_calls_costs_nothing_but_the_lane(slice_):
    step = _on(slice_, keep_warm=60)(_count)
    assert step() == 1 and step() == 2
    if shutil.which("ss") is None:
        pytest.skip("no ss here (iproute2) to cut a TCP connection")
    done = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=",
                           str(slice_.data_ports[0])], capture_output=True, text=True)
    if done.returncode or not wait_until(lambda: _lanes_to(slice_) == 0, timeout=2):
        pytest.skip(f"cannot cut a TCP connection here (ss -K): {done.stderr.strip()}")
    assert step() == 3                           # on gRPC, same workers, same state
    assert _lanes_to(slice_) == 1                # and a lane again


@pytest.mark.parametrize("forked", [False, True])
def test_a_caller_killed_during_a_lane_call_cancels_it_on_every_host(slice_, forked):
    """Also when the caller had forked a child, which holds a copy of the lane's
    socket: a lane ended by its caller must end for the gateway."""
    code = ("import os, time, remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={slice_.addresses[0]!r}, "
            f"token={slice_.token!r}, stream='none', keep_warm=60)\n"
            "def step(sleep):\n"
            "    time.sleep(sleep)\n"
            "    return 1\n"
            "step(0)\n"
            + ("if os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n" if forked else "")
            + "print('calling', flush=True)\n"
            "step(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)      # (the child too, killed at the end)
    try:
        assert proc.stdout.readline().strip() == "calling"
        assert wait_until(lambda: _lanes_to(slice_, proc.pid) == 1, timeout=10)

        def running():
            return [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
                    if j.state == "RUNNING"]
        assert wait_until(running, timeout=10)
        proc.send_signal(signal.SIGKILL)
        start = time.monotonic()
        assert wait_until(lambda: not running(), timeout=10)
        assert time.monotonic() - start < 5
        job = remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)[0]
        assert job.state == "CANCELLED" and "went away" in job.detail, job
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()


def _cut_lanes(agents) -> bool:
    """Reset every connection to the gateway's data port, as a flaky link or a
    middlebox would (both ends see a reset); False where it cannot be done here."""
    if shutil.which("ss") is None:
        return False
    subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(agents.data_ports[0])],
                   capture_output=True)
    return wait_until(lambda: _lanes_to(agents) == 0, timeout=2)


def _slow_count(sleep):
    time.sleep(sleep)
    return _count()


def test_a_lane_broken_after_its_call_started_hands_the_call_to_grpc_unharmed(slice_):
    """The lane breaks after the gateway started the call, before its first
    event came: the caller sends it again on gRPC under the same job id, which
    follows the running call. It runs once, its value comes back, and the warm
    state stays (before: the gateway took the break for the caller going away
    and cancelled the call; the resend found it cancelled, the warm workers gone)."""
    before = {j.id for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)}
    step = _on(slice_, keep_warm=60)(_slow_count)
    assert step(0) == 1 and _lanes_to(slice_) == 1
    cut: list[bool] = []

    def cutter():
        assert wait_until(lambda: any(j.state == "RUNNING" for j in remote_tpu.jobs(
            hosts=slice_.addresses[0], token=slice_.token)), timeout=10)
        cut.append(_cut_lanes(slice_))
    thread = threading.Thread(target=cutter, daemon=True)
    thread.start()
    assert step(3) == 2                          # once: the count went up by one
    thread.join(10)
    if not cut or not cut[0]:
        pytest.skip("cannot cut a TCP connection here (ss -K)")
    calls = [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
             if j.id not in before and j.state != "WARM"]   # the warm session: a job too
    assert [j.state for j in calls] == ["SUCCEEDED", "SUCCEEDED"], calls
    assert step(0) == 3                          # the same workers, the same state


def test_a_lane_broken_with_no_resend_coming_cancels_its_call(slice_):
    """A break no resend follows (the caller's host gone, or its process
    killed with output unread: a reset) ends the call within RESEND_SECONDS."""
    step = _on(slice_, keep_warm=60)(lambda sleep: __import__("time").sleep(sleep))
    step(0)
    from remote_tpu._core.serialization import dumps_call
    from remote_tpu._client import _requests, _spec, _target
    from remote_tpu._trees import Trees
    payload = dumps_call(step._fn, (30,), {})
    spec = _spec(step.options, payload, "reset-1", _target(step.options), Trees())
    conn = lane._take(next(iter(lane._lanes)))
    conn.send(lane.CALL, conn.new_id(), next(_requests(spec, payload)).SerializeToString())
    sock = conn.sock

    def state():
        return {j.id: j.state for j in remote_tpu.jobs(
            hosts=slice_.addresses[0], token=slice_.token)}.get("reset-1")
    assert wait_until(lambda: state() == "RUNNING", timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()                                  # a reset, not a goodbye
    start = time.monotonic()
    assert wait_until(lambda: state() == "CANCELLED", timeout=10), state()
    assert time.monotonic() - start < lane_server.RESEND_SECONDS + 3
    job = {j.id: j for j in remote_tpu.jobs(hosts=slice_.addresses[0],
                                            token=slice_.token)}["reset-1"]
    assert "no resend" in job.detail, job


def test_a_call_whose_caller_goes_away_at_once_is_cancelled(slice_):
    """The call is sent on the lane and the lane closed right after, before the
    gateway has started the call: it must not run with nobody attached."""
    step = _on(slice_, keep_warm=60)(lambda sleep: __import__("time").sleep(sleep))
    step(0)
    from remote_tpu._core.serialization import dumps_call
    from remote_tpu._client import _requests, _spec, _target
    from remote_tpu._trees import Trees
    for i in range(5):
        payload = dumps_call(step._fn, (30,), {})
        spec = _spec(step.options, payload, f"gone-{i}", _target(step.options), Trees())
        conn = lane._take(next(iter(lane._lanes)))
        conn.send(lane.CALL, conn.new_id(), next(_requests(spec, payload)).SerializeToString())
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()

        def state():
            return {j.id: j.state for j in remote_tpu.jobs(
                hosts=slice_.addresses[0], token=slice_.token)}.get(f"gone-{i}")
        assert wait_until(lambda: state() in ("CANCELLED", None), timeout=10), state()
        step(0)                                     # (a new lane, for the next round)


def test_buffers_evicted_since_they_were_sent_go_inside_the_call_on_a_lane_too(
        slice_, monkeypatch):
    """The gateway refuses the call (its argument cache lacks the buffers the
    caller was told it had): the caller sends them inside the call instead, as
    it does on gRPC, and the refusal does not end the lane."""
    import numpy as np
    from remote_tpu import _client

    step = _on(slice_, keep_warm=60)(lambda a=None: 0.0 if a is None else float(a.sum()))
    assert step() == 0.0
    monkeypatch.setattr(_client.blobs, "send", lambda target, payload, progress=None, beside=0: [
        pb.BlobRef(digest=d, size=b.nbytes)
        for d, b in zip(payload.blob_digests(), payload.blobs)])     # said held, never sent
    assert step(np.ones(1 << 19, dtype=np.float32)) == float(1 << 19)
    assert _lanes_to(slice_) == 1


def test_a_caller_whose_host_goes_silent_has_its_call_cancelled(slice_):
    """Its host gone without a word (no FIN: packets dropped): the gateway's
    keepalive finds it within seconds, as gRPC's does for RunInline."""
    need_iptables()
    step = _on(slice_, keep_warm=60)(lambda sleep: __import__("time").sleep(sleep))
    step(0)
    ended: list[BaseException] = []

    def call():
        try:
            step(60)
        except BaseException as exc:        # noqa: BLE001 - said below
            ended.append(exc)
    caller = threading.Thread(target=call, daemon=True)
    caller.start()

    def running():
        return [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
                if j.state == "RUNNING"]
    assert wait_until(running, timeout=10)
    with dropping(slice_.data_ports[0]):
        start = time.monotonic()
        assert wait_until(lambda: not running(), timeout=20)
        assert time.monotonic() - start < 10
    job = remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)[0]
    assert job.state == "CANCELLED" and "went away" in job.detail, job
    caller.join(30)                  # this end finds the lane gone too (its keepalive)
    assert ended and not caller.is_alive()


def test_a_forked_child_does_not_use_its_parents_lane(slice_):
    step = _on(slice_, keep_warm=60)(_count)
    step()
    key = next(iter(lane._lanes))
    pid = os.fork()
    if pid == 0:                                  # the child: the lane is not its own
        os._exit(0 if lane._take(key) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert step() == 2 and _lanes_to(slice_) == 1   # the parent's still works


def test_a_caller_that_stops_for_a_while_loses_nothing(slice_):
    """A caller that reads nothing for a while (its output piped to a reader
    that pauses; here its whole process stopped, longer than a vanished
    caller is waited for) fills its lane, and the gateway's sends wait. Its
    kernel still answers, so it is not gone, and its call is not cancelled:
    once it goes on, every line arrives, and the value. (Its lane used to
    take it as gone after 3 s and cancel the call.)"""
    lines = 100_000                        # 10 MB: far past both ends' socket buffers
    code = (
        "import sys, remote_tpu\n"
        "from remote_tpu import _call_lane as lane\n"
        "used = []\n"
        "real = lane.start\n"
        "def start(*a, **k):\n"
        "    stream = real(*a, **k)\n"
        "    used.append(stream is not None)\n"
        "    return stream\n"
        "lane.start = start\n"
        f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={slice_.addresses[0]!r}, "
        f"token={slice_.token!r}, keep_warm=60)\n"
        "def flood(n):\n"
        "    import sys\n"
        "    for i in range(n):\n"
        "        sys.stdout.write(f'{i:09d} ' + 'x' * 89 + '\\n')\n"
        "    return n\n"
        "flood(0)\n"
        "print('warm', flush=True)\n"
        f"value = flood({lines})\n"
        "print(f'value {value}', flush=True)\n"
        "print(f'lane {used}', file=sys.stderr)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"warm\n"
        time.sleep(1)                      # the flood fills its lane meanwhile
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(lane_server.UNANSWERED_SECONDS + 2)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "lane [False, True]" in err.decode(), err.decode()[-2000:]   # the 2nd: on the lane
    got = out.decode().splitlines()
    assert got[-1] == f"value {lines}"
    assert [line[:9] for line in got[:-1]] == [f"{i:09d}" for i in range(lines)]


def test_a_caller_whose_host_goes_silent_while_its_output_waits_is_cancelled(slice_):
    """The other side: a caller whose host is gone without a word while its
    call's output fills the lane (no keepalive probes then: something is
    unacknowledged) is taken as gone once its kernel has left our probes
    unanswered for 10 s, and the call is cancelled."""
    need_iptables()
    code = (
        "import remote_tpu\n"
        f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={slice_.addresses[0]!r}, "
        f"token={slice_.token!r}, keep_warm=60)\n"
        "def flood(forever):\n"
        "    import sys\n"
        "    while forever:\n"
        "        sys.stdout.write('x' * 99 + '\\n')\n"
        "flood(False)\n"
        "print('warm', flush=True)\n"
        "flood(True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline() == b"warm\n"

        def second():
            found = [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
                     if j.id.startswith("flood-") and j.state != "SUCCEEDED"]
            return found[0] if found else None
        assert wait_until(lambda: second() is not None and second().state == "RUNNING",
                          timeout=30)
        with dropping(slice_.data_ports[0]):
            start = time.monotonic()
            assert wait_until(lambda: second().finished, timeout=60), second()
            assert time.monotonic() - start > lane_server.UNANSWERED_SECONDS
        assert second().state == "CANCELLED" and "went away" in second().detail, second()
    finally:
        proc.kill()
        proc.wait()
