"""retries=: a preemption (a host gone) retried many times, a failure of the
user's code a few times or not at all; each attempt a new job with
REMOTE_TPU_ATTEMPT; the caller sees one call."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

import remote_tpu
from remote_tpu._core.exceptions import (AgentUnavailableError, ConfigurationError,
                                         JobFailedError, SerializationError)
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._retries import FAILURE, PREEMPTION, Retries, coerce, kind_of


pytestmark = pytest.mark.timeout(180)


def _ended(state: int, root: int = -1, root_state: int = pb.HOST_STATE_FAILED) -> Exception:
    exc = JobFailedError("ended")
    hosts = [pb.HostReport(host=i, state=pb.HOST_STATE_CANCELLED) for i in range(2)]
    if root >= 0:
        hosts[root].state = root_state
    exc.remote_tpu_end = pb.JobEnd(state=state, root_cause_host=root, hosts=hosts)
    return exc


def test_ends_are_told_apart():
    assert kind_of(_ended(pb.JOB_STATE_PREEMPTED, 1)) == PREEMPTION
    assert kind_of(_ended(pb.JOB_STATE_LOST)) == PREEMPTION
    assert kind_of(_ended(pb.JOB_STATE_FAILED, 1, pb.HOST_STATE_LOST)) == PREEMPTION
    assert kind_of(AgentUnavailableError("gone")) == PREEMPTION
    assert kind_of(_ended(pb.JOB_STATE_FAILED, 0)) == FAILURE           # the function raised
    assert kind_of(_ended(pb.JOB_STATE_FAILED, 0, pb.HOST_STATE_DIED)) == FAILURE
    assert kind_of(_ended(pb.JOB_STATE_TIMED_OUT, 0)) == FAILURE
    assert kind_of(_ended(pb.JOB_STATE_CANCELLED)) is None
    for refused in (ConfigurationError("bad"), SerializationError("x"), KeyboardInterrupt()):
        assert kind_of(refused) is None                                # nothing ran


def test_retries_options():
    assert coerce(None) is None and coerce(0) is None
    assert coerce(3) == Retries(preemptions=3, failures=3)
    assert coerce(Retries(failures=2)).preemptions == 100
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ConfigurationError):
            coerce(bad)
    with pytest.raises(ConfigurationError, match="failures"):
        Retries(failures=-1)


@pytest.mark.parametrize("preemptions, failures, ok", [
    (200, 0, True), (0, 200, True), (100, 100, True),      # exactly the limit
    (201, 0, False), (100, 101, False), (10**9, 10**9, False)])
def test_at_most_200_retries_in_all(preemptions, failures, ok):
    """The bound that keeps every status's list of attempts bounded."""
    if ok:
        assert Retries(preemptions=preemptions, failures=failures, backoff=0)
        return
    with pytest.raises(ConfigurationError, match="at most 200 retries in all"):
        Retries(preemptions=preemptions, failures=failures)
    with pytest.raises(ConfigurationError, match="at most 200 retries in all"):
        coerce(preemptions + failures)


def _on(agents, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, init_jax=False, stream="none", **kw)


def _flaky(until: int):
    """Raises on its first attempts; returns the attempt that worked."""
    import os
    attempt = int(os.environ["REMOTE_TPU_ATTEMPT"])
    if attempt < until:
        raise RuntimeError(f"attempt {attempt} broke")
    return attempt


def test_a_failure_is_retried_as_often_as_allowed(agents, capfd):
    fn = _on(agents, retries=Retries(failures=2, backoff=0))(_flaky)
    assert fn(2) == 2
    err = capfd.readouterr().err
    assert err.count("retrying") == 2
    assert re.search(r"ended by a failure \(host \d raised builtins.RuntimeError: attempt 0 broke",
                     err), err
    with pytest.raises(RuntimeError, match="attempt 2 broke") as info:
        fn(3)
    notes = "".join(info.value.__notes__)
    assert "earlier attempts ended by" in notes and "attempt 0 broke" in notes
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="attempt 0 broke"):
        _on(agents, retries=Retries(preemptions=5, backoff=0))(_flaky)(1)   # failures: 0
    assert "retrying" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_host_that_vanishes_is_a_preemption_retried_until_it_is_back(agents, tmp_path, capfd):
    started = tmp_path / "started"

    def long_job(marker):
        import os
        import time
        attempt = int(os.environ["REMOTE_TPU_ATTEMPT"])
        if attempt == 0:
            open(marker, "w").close()
            time.sleep(60)                 # host 1's agent is killed meanwhile
        return attempt

    def kill_and_restart():
        deadline = time.time() + 60
        while not started.exists() and time.time() < deadline:
            time.sleep(0.05)
        agents.procs[1].send_signal(signal.SIGKILL)
        time.sleep(1)
        agents.restart(1)

    helper = threading.Thread(target=kill_and_restart, daemon=True)
    helper.start()
    fn = _on(agents, retries=Retries(preemptions=10, failures=0, backoff=0.5, backoff_max=2))
    assert fn(long_job)(str(started)) >= 1
    helper.join(30)
    assert "ended by a preemption" in capfd.readouterr().err
    assert os.path.exists(started)
