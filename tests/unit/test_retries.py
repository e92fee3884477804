"""retries=: a preemption (a host gone) retried many times, a failure of the
user's code a few times or not at all; each attempt a new job with
REMOTE_TPU_ATTEMPT; the caller sees one call. The rules, without agents; on
real agents: tests/slice/test_job_retries.py."""

from __future__ import annotations

import threading

import pytest

from conftest import wait_until
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


def test_a_gateway_never_reached_is_not_retried_but_one_lost_later_is(capfd):
    from remote_tpu._core.exceptions import AgentUnavailableError
    from remote_tpu._retries import run

    calls = []

    def never_there(attempt, earlier):
        calls.append(attempt)
        raise AgentUnavailableError("no remote_tpu agent answered at 10.0.0.9:8475")

    with pytest.raises(AgentUnavailableError):
        run(Retries(preemptions=5, backoff=0), never_there)
    assert calls == [0] and "retrying" not in capfd.readouterr().err     # a wrong address

    def lost_then_back(attempt, earlier):
        calls.append(attempt)
        if attempt == 1:
            raise AgentUnavailableError("the gateway went away")   # reached once: a loss
        if attempt == 0:
            raise _ended_by_a_lost_host()
        return [a.kind for a in earlier]

    calls.clear()
    assert run(Retries(preemptions=5, backoff=0), lost_then_back) == ["preemption"] * 2
    assert calls == [0, 1, 2]


def _ended_by_a_lost_host() -> Exception:
    from remote_tpu._core.proto import remote_tpu_pb2 as pb

    exc = JobFailedError("host 1 lost")
    exc.remote_tpu_end = pb.JobEnd(state=pb.JOB_STATE_LOST, root_cause_host=1, hosts=[
        pb.HostReport(host=0), pb.HostReport(host=1, state=pb.HOST_STATE_LOST)])
    return exc


def test_every_worker_is_told_its_attempt_even_without_retries():
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu_agent.worker.environment import worker_env

    def attempt(**kw):
        spec = pb.JobSpec(job_id="j", accelerator="tpu-v4-16", num_hosts=2, **kw)
        return worker_env({}, spec=spec, process_id=0, coordinator="h:1",
                          simulate_devices=2)["REMOTE_TPU_ATTEMPT"]

    assert attempt() == "0"                     # a warm worker never keeps an earlier one
    assert attempt(retries=pb.RetryPolicy(failures=1), attempt=2) == "2"
    assert attempt(env={"REMOTE_TPU_ATTEMPT": "3"}) == "3"       # the caller's own count


def test_a_cancel_while_an_attempt_winds_down_is_not_lost(tmp_path):
    """The window between an attempt's end and its backoff: the scheduler
    still holds the job, so a cancel ends it instead of the next attempt."""
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu_agent.gateway.scheduler import Scheduler
    from remote_tpu_agent.jobs.store import JobStore

    ended, go_on, runs = threading.Event(), threading.Event(), []

    class Winding:
        """A job whose end is reported before its run() has wound down."""
        n, session_id = 1, ""

        def __init__(self, record):
            self.record = record

        def cancel(self, reason, state=pb.JOB_STATE_CANCELLED):
            pass

        def kept_session(self, store):
            return None

        def run(self):
            runs.append(self.record.spec.attempt)
            yield pb.Event(end=pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=0, hosts=[
                pb.HostReport(host=0, state=pb.HOST_STATE_FAILED, detail="boom")]))
            if len(runs) == 1:
                ended.set()
                go_on.wait(10)

    store = JobStore(str(tmp_path))
    scheduler = Scheduler(lambda record, warm: Winding(record))
    spec = pb.JobSpec(job_id="j1", accelerator="tpu-v4-8", num_hosts=1, role=pb.ROLE_GATEWAY,
                      retries=pb.RetryPolicy(failures=3, backoff_seconds=0.2,
                                             backoff_max_seconds=0.2))
    record, _ = store.create(spec, pb.ROLE_GATEWAY)
    try:
        scheduler.submit(record)
        assert ended.wait(10)
        assert scheduler.cancel("j1", "cancelled on request")
        go_on.set()
        assert wait_until(lambda: record.finished, 10)
        assert record.status.phase == pb.JOB_PHASE_CANCELLED and runs == [0]
    finally:
        go_on.set()
        scheduler.shutdown("test over")
