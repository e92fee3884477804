"""The gateway's scheduler, directly: one job at a time per slice, first come
first served, over a real job store. A stand-in job takes the place of a
GatewayJob (no workers, no peers). Fast, no agents, no JAX."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from conftest import wait_until
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.gateway.scheduler import Scheduler
from remote_tpu_agent.host.idle import IdleClock
from remote_tpu_agent.jobs.store import JobStore

pytestmark = pytest.mark.timeout(60)

OUT = pb.OUTPUT_STREAM_STDOUT
ERR = pb.OUTPUT_STREAM_STDERR


class StandInJob:
    """What the scheduler uses of a GatewayJob: ``n``, ``run()`` (output events as
    they come, then one ``end``), ``cancel(reason, state)`` (the job then ends in
    ``state`` with ``reason``, as a GatewayJob's cancel does, also when called
    before ``run``) and ``stacks()``. The test says when it prints and ends."""

    def __init__(self, record, n: int = 1) -> None:
        self.job_id = record.job_id
        self.n = n
        self.cancels: list[tuple[str, int]] = []
        self.session_id = ""             # never warm (keep_warm is tested end to end)
        self.running = threading.Event()
        self.ended = threading.Event()
        self._items: queue.Queue = queue.Queue()

    # what the scheduler calls
    def cancel(self, reason: str, state: int = pb.JOB_STATE_CANCELLED) -> None:
        self.cancels.append((reason, state))
        self._items.put(pb.JobEnd(state=state, root_cause_host=-1, detail=reason))

    def stacks(self) -> list[pb.HostStacks]:
        return [pb.HostStacks(host=h, text=f"{self.job_id} host {h}: in main")
                for h in range(self.n)]

    def kept_session(self, store):
        return None

    def result_data(self):
        return None, ""

    def run(self):
        self.running.set()
        try:
            while True:
                item = self._items.get(timeout=30)
                if isinstance(item, pb.JobEnd):
                    yield pb.Event(host=0, end=item)
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.ended.set()

    # what the test calls
    def output(self, data: bytes, host: int = 0, stream: int = OUT) -> None:
        self._items.put(pb.Event(host=host, output=pb.Output(stream=stream, data=data)))

    def finish(self, state: int = pb.JOB_STATE_SUCCEEDED, detail: str = "",
               root_cause_host: int = -1) -> None:
        self._items.put(pb.JobEnd(state=state, root_cause_host=root_cause_host,
                                  detail=detail))

    def crash(self, exc: Exception) -> None:
        """run() raises ``exc`` (a bug in the job's own code)."""
        self._items.put(exc)


class Jobs:
    """``make_job`` for a Scheduler: a StandInJob per record, in the order asked
    for; ``fail`` names jobs whose making raises, ``hold`` jobs whose making
    waits until ``release``."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.by_id: dict[str, StandInJob] = {}
        self.fail: dict[str, Exception] = {}
        self.hold: set[str] = set()
        self.making = threading.Event()
        self.release = threading.Event()

    def __call__(self, record, warm=None) -> StandInJob:
        self.made.append(record.job_id)
        if record.job_id in self.hold:
            self.making.set()
            assert self.release.wait(10)
        if record.job_id in self.fail:
            raise self.fail[record.job_id]
        job = StandInJob(record)
        self.by_id[record.job_id] = job
        return job

    def __getitem__(self, job_id: str) -> StandInJob:
        eventually(lambda: job_id in self.by_id, f"job {job_id} was never made")
        return self.by_id[job_id]


def eventually(predicate, what: str, timeout: float = 5.0) -> None:
    assert wait_until(predicate, timeout, interval=0.005), f"not within {timeout} s: {what}"


def status(record) -> pb.JobStatus:
    with record.changed:
        copy = pb.JobStatus()
        copy.CopyFrom(record.status)
        return copy


def phase(record) -> int:
    return status(record).phase


def await_phase(record, wanted: int) -> pb.JobStatus:
    eventually(lambda: phase(record) == wanted,
               f"{record.job_id} {pb.JobPhase.Name(wanted)} "
               f"(it is {pb.JobPhase.Name(phase(record))})")
    return status(record)


def queued(record) -> tuple[int, str]:
    s = status(record)
    return s.queue_position, s.queued_behind


@pytest.fixture
def store(tmp_path):
    s = JobStore(str(tmp_path / "state"))
    yield s
    s.close()


@pytest.fixture
def jobs():
    return Jobs()


@pytest.fixture
def scheduler(jobs):
    s = Scheduler(jobs)
    yield s
    jobs.release.set()
    s.shutdown("test over", timeout=5)


def new(store, job_id: str):
    record, created = store.create(pb.JobSpec(job_id=job_id, num_hosts=1), pb.ROLE_GATEWAY)
    assert created
    return record


# ---------------------------------------------------------------- FIFO

def test_three_jobs_run_one_at_a_time_in_submission_order(store, jobs, scheduler):
    a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
    for record in (a, b, c):
        scheduler.submit(record)

    await_phase(a, pb.JOB_PHASE_RUNNING)
    assert jobs.made == ["a"]
    assert (phase(b), phase(c)) == (pb.JOB_PHASE_QUEUED, pb.JOB_PHASE_QUEUED)
    jobs["a"].finish()

    await_phase(b, pb.JOB_PHASE_RUNNING)
    assert phase(a) == pb.JOB_PHASE_SUCCEEDED
    assert phase(c) == pb.JOB_PHASE_QUEUED
    assert jobs.made == ["a", "b"]
    jobs["b"].finish()

    await_phase(c, pb.JOB_PHASE_RUNNING)
    jobs["c"].finish()
    await_phase(c, pb.JOB_PHASE_SUCCEEDED)
    assert jobs.made == ["a", "b", "c"]
    sa, sb, sc = status(a), status(b), status(c)
    assert sa.ended_at <= sb.started_at and sb.ended_at <= sc.started_at
    assert [s.end.state for s in (sa, sb, sc)] == [pb.JOB_STATE_SUCCEEDED] * 3


def test_queued_jobs_say_their_place_and_who_is_ahead(store, jobs, scheduler):
    a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
    for record in (a, b, c):
        scheduler.submit(record)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    assert queued(a) == (0, "")
    assert queued(b) == (1, "a")
    assert queued(c) == (2, "b")


def test_places_move_up_as_the_queue_moves(store, jobs, scheduler):
    a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
    for record in (a, b, c):
        scheduler.submit(record)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    jobs["a"].finish()
    await_phase(b, pb.JOB_PHASE_RUNNING)
    assert queued(b) == (0, "")
    assert queued(c) == (1, "b")
    jobs["b"].finish()
    await_phase(c, pb.JOB_PHASE_RUNNING)
    assert queued(c) == (0, "")


def test_a_job_submitted_to_an_idle_slice_runs_at_once(store, jobs, scheduler):
    a = new(store, "a")
    scheduler.submit(a)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    jobs["a"].finish()
    await_phase(a, pb.JOB_PHASE_SUCCEEDED)
    b = new(store, "b")
    scheduler.submit(b)
    await_phase(b, pb.JOB_PHASE_RUNNING)
    assert queued(b) == (0, "")


def test_a_jobs_output_and_final_report_reach_its_record(store, jobs, scheduler):
    a = new(store, "a")
    scheduler.submit(a)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    jobs["a"].output(b"hello\n")
    jobs["a"].output(b"warning\n", stream=ERR)
    jobs["a"].output(b"from host 1\n", host=1)
    jobs["a"].finish(pb.JOB_STATE_FAILED, "host 1 failed: ValueError: boom", root_cause_host=1)
    s = await_phase(a, pb.JOB_PHASE_FAILED)
    assert s.detail == "host 1 failed: ValueError: boom"
    assert (s.end.state, s.end.root_cause_host) == (pb.JOB_STATE_FAILED, 1)
    assert [(st, d) for st, d, _ in a.log(0).read(0)] == [(OUT, b"hello\n"),
                                                          (ERR, b"warning\n")]
    assert [(st, d) for st, d, _ in a.log(1).read(0)] == [(OUT, b"from host 1\n")]


@pytest.mark.parametrize("state, phase_", [
    (pb.JOB_STATE_TIMED_OUT, pb.JOB_PHASE_TIMED_OUT),
    (pb.JOB_STATE_LOST, pb.JOB_PHASE_LOST),
    (pb.JOB_STATE_PREEMPTED, pb.JOB_PHASE_PREEMPTED),
])
def test_the_final_state_becomes_the_phase_of_the_same_name(store, jobs, scheduler,
                                                            state, phase_):
    a = new(store, "a")
    scheduler.submit(a)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    jobs["a"].finish(state, "why")
    assert await_phase(a, phase_).end.state == state


def test_stacks_come_from_the_running_job_only(store, jobs, scheduler):
    a, b = new(store, "a"), new(store, "b")
    scheduler.submit(a)
    scheduler.submit(b)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    assert scheduler.stacks("a") == [pb.HostStacks(host=0, text="a host 0: in main")]
    assert scheduler.stacks("b") is None
    assert scheduler.stacks("nobody") is None
    jobs["a"].finish()
    await_phase(b, pb.JOB_PHASE_RUNNING)            # the scheduler has moved on
    assert scheduler.stacks("a") is None
    assert scheduler.stacks("b") == [pb.HostStacks(host=0, text="b host 0: in main")]


# ---------------------------------------------------------------- cancel

def test_cancelling_a_queued_job_takes_it_out_of_the_queue(store, jobs, scheduler):
    a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
    for record in (a, b, c):
        scheduler.submit(record)
    await_phase(a, pb.JOB_PHASE_RUNNING)

    assert scheduler.cancel("b", "cancelled on request") is True
    s = status(b)
    assert s.phase == pb.JOB_PHASE_CANCELLED
    assert s.detail == "cancelled on request"
    assert s.end.state == pb.JOB_STATE_CANCELLED
    assert s.end.detail == "cancelled on request (while queued)"
    assert s.end.root_cause_host == -1
    assert (s.queue_position, s.queued_behind) == (0, "")
    assert queued(c) == (1, "a")
    assert jobs["a"].cancels == []

    jobs["a"].finish()
    await_phase(c, pb.JOB_PHASE_RUNNING)
    jobs["c"].finish()
    await_phase(c, pb.JOB_PHASE_SUCCEEDED)
    assert jobs.made == ["a", "c"]
    assert phase(b) == pb.JOB_PHASE_CANCELLED


def test_cancelling_the_last_queued_job_leaves_the_others_in_place(store, jobs, scheduler):
    a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
    for record in (a, b, c):
        scheduler.submit(record)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    assert scheduler.cancel("c", "changed my mind") is True
    assert queued(b) == (1, "a")
    assert status(c).end.detail == "changed my mind (while queued)"


def test_cancelling_the_running_job_cancels_it_and_the_next_one_runs(store, jobs, scheduler):
    a, b = new(store, "a"), new(store, "b")
    scheduler.submit(a)
    scheduler.submit(b)
    await_phase(a, pb.JOB_PHASE_RUNNING)

    assert scheduler.cancel("a", "cancelled on request") is True
    assert jobs["a"].cancels == [("cancelled on request", pb.JOB_STATE_CANCELLED)]
    s = await_phase(a, pb.JOB_PHASE_CANCELLED)
    assert s.detail == "cancelled on request"
    assert s.end.state == pb.JOB_STATE_CANCELLED
    assert s.end.detail == "cancelled on request"        # not "(while queued)"
    await_phase(b, pb.JOB_PHASE_RUNNING)
    assert queued(b) == (0, "")


def test_cancelling_the_running_job_passes_its_final_state_on(store, jobs, scheduler):
    a = new(store, "a")
    scheduler.submit(a)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    assert scheduler.cancel("a", "the disk is full", pb.JOB_STATE_FAILED) is True
    assert jobs["a"].cancels == [("the disk is full", pb.JOB_STATE_FAILED)]
    assert await_phase(a, pb.JOB_PHASE_FAILED).end.detail == "the disk is full"


def test_cancelling_a_job_the_scheduler_does_not_have_says_so(store, jobs, scheduler):
    a, b = new(store, "a"), new(store, "b")
    scheduler.submit(a)
    scheduler.submit(b)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    assert scheduler.cancel("nobody", "why") is False
    jobs["a"].finish()
    await_phase(b, pb.JOB_PHASE_RUNNING)            # the scheduler has moved on
    assert scheduler.cancel("a", "too late") is False
    assert jobs["a"].cancels == []
    assert status(a).end.state == pb.JOB_STATE_SUCCEEDED


def test_a_job_cancelled_while_being_made_is_cancelled_once_it_exists(store, jobs, scheduler):
    a, b = new(store, "a"), new(store, "b")
    jobs.hold.add("a")
    scheduler.submit(a)
    scheduler.submit(b)
    assert jobs.making.wait(5)
    assert scheduler.cancel("a", "cancelled on request") is True
    jobs.release.set()
    s = await_phase(a, pb.JOB_PHASE_CANCELLED)
    assert jobs["a"].cancels == [("cancelled on request", pb.JOB_STATE_CANCELLED)]
    assert s.end.detail == "cancelled on request"
    await_phase(b, pb.JOB_PHASE_RUNNING)
    assert jobs["b"].cancels == []                 # the early cancel was a's alone


# ---------------------------------------------------------------- errors

def test_a_job_that_cannot_be_made_fails_and_the_next_one_still_runs(store, jobs, scheduler):
    a, b = new(store, "a"), new(store, "b")
    jobs.fail["a"] = RuntimeError("no free port on 10.0.0.2")
    scheduler.submit(a)
    scheduler.submit(b)
    s = await_phase(a, pb.JOB_PHASE_FAILED)
    assert s.detail == "internal error in the agent: no free port on 10.0.0.2"
    assert s.end.state == pb.JOB_STATE_FAILED
    assert s.end.root_cause_host == -1
    assert s.end.detail == "internal error in the agent: no free port on 10.0.0.2"
    await_phase(b, pb.JOB_PHASE_RUNNING)
    jobs["b"].finish()
    assert await_phase(b, pb.JOB_PHASE_SUCCEEDED).end.state == pb.JOB_STATE_SUCCEEDED
    assert jobs.made == ["a", "b"]


def test_a_job_whose_run_breaks_fails_and_the_next_one_still_runs(store, jobs, scheduler):
    a, b = new(store, "a"), new(store, "b")
    scheduler.submit(a)
    scheduler.submit(b)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    jobs["a"].output(b"before\n")
    jobs["a"].crash(KeyError("host 3"))
    s = await_phase(a, pb.JOB_PHASE_FAILED)
    assert s.end.detail == "internal error in the agent: 'host 3'"
    assert jobs["a"].ended.is_set()
    assert s.end.root_cause_host == -1
    assert [d for _, d, _ in a.log(0).read(0)] == [b"before\n"]
    await_phase(b, pb.JOB_PHASE_RUNNING)


# ---------------------------------------------------------------- shutdown

def test_shutdown_cancels_queued_and_running_jobs_with_its_reason(store, jobs):
    scheduler = Scheduler(jobs)
    a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
    for record in (a, b, c):
        scheduler.submit(record)
    await_phase(a, pb.JOB_PHASE_RUNNING)

    reason = "the gateway agent at 10.0.0.2:50051 is shutting down"
    started = time.monotonic()
    scheduler.shutdown(reason, timeout=5)
    assert time.monotonic() - started < 4, "the scheduler's thread did not end"

    assert jobs["a"].cancels == [(reason, pb.JOB_STATE_CANCELLED)]
    assert jobs["a"].ended.is_set()
    sa = status(a)
    assert (sa.phase, sa.end.state, sa.end.detail) == (
        pb.JOB_PHASE_CANCELLED, pb.JOB_STATE_CANCELLED, reason)
    for record in (b, c):
        s = status(record)
        assert (s.phase, s.end.state) == (pb.JOB_PHASE_CANCELLED, pb.JOB_STATE_CANCELLED)
        assert s.end.detail == f"{reason} (while queued)"
    assert jobs.made == ["a"]


def test_shutdown_on_preemption_ends_the_running_job_preempted(store, jobs):
    scheduler = Scheduler(jobs)
    a = new(store, "a")
    scheduler.submit(a)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    scheduler.shutdown("host 10.0.0.3 was preempted", pb.JOB_STATE_PREEMPTED, timeout=5)
    assert jobs["a"].cancels == [("host 10.0.0.3 was preempted", pb.JOB_STATE_PREEMPTED)]
    s = status(a)
    assert (s.phase, s.end.state) == (pb.JOB_PHASE_PREEMPTED, pb.JOB_STATE_PREEMPTED)


def test_shutdown_on_preemption_ends_queued_jobs_preempted_too(store, jobs):
    scheduler = Scheduler(jobs)
    a, b = new(store, "a"), new(store, "b")
    scheduler.submit(a)
    scheduler.submit(b)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    scheduler.shutdown("host 10.0.0.3 was preempted", pb.JOB_STATE_PREEMPTED, timeout=5)
    s = status(b)
    assert s.end.detail == "host 10.0.0.3 was preempted (while queued)"
    assert (s.phase, s.end.state) == (pb.JOB_PHASE_PREEMPTED, pb.JOB_STATE_PREEMPTED)


def test_shutdown_on_preemption_while_a_job_is_being_made_ends_it_preempted(store, jobs):
    scheduler = Scheduler(jobs)
    a = new(store, "a")
    jobs.hold.add("a")
    scheduler.submit(a)
    assert jobs.making.wait(5)
    threading.Timer(0.3, jobs.release.set).start()
    scheduler.shutdown("host 10.0.0.3 was preempted", pb.JOB_STATE_PREEMPTED, timeout=5)
    s = status(a)                        # shutdown has waited for the job to end
    assert s.end.detail == "host 10.0.0.3 was preempted"
    assert (s.phase, s.end.state) == (pb.JOB_PHASE_PREEMPTED, pb.JOB_STATE_PREEMPTED)


def test_shutdown_while_a_job_is_being_made_cancels_it_once_it_exists(store, jobs):
    scheduler = Scheduler(jobs)
    a = new(store, "a")
    jobs.hold.add("a")
    scheduler.submit(a)
    assert jobs.making.wait(5)
    threading.Timer(0.3, jobs.release.set).start()
    scheduler.shutdown("the agent is stopping", timeout=5)
    s = status(a)                        # shutdown has waited for the job to end
    assert s.phase == pb.JOB_PHASE_CANCELLED
    assert jobs["a"].cancels == [("the agent is stopping", pb.JOB_STATE_CANCELLED)]
    assert s.end.detail == "the agent is stopping"


def test_shutdown_of_an_idle_scheduler_returns_at_once(jobs):
    scheduler = Scheduler(jobs)
    started = time.monotonic()
    scheduler.shutdown("stopping", timeout=5)
    assert time.monotonic() - started < 4
    assert jobs.made == []


# ---------------------------------------------------------------- idle (--idle-delete)

def test_the_idle_clock_hears_when_jobs_run_or_wait_and_when_none_does(store, jobs):
    clock = IdleClock(3600.0, lambda idle: True)      # (never rings here: it is not started)
    scheduler = Scheduler(jobs, idle=clock)
    try:
        assert clock.idle_for() > 0
        a, b, c = new(store, "a"), new(store, "b"), new(store, "c")
        for record in (a, b, c):
            scheduler.submit(record)
        await_phase(a, pb.JOB_PHASE_RUNNING)
        scheduler.cancel("c", "not wanted")            # one of two queued: still busy
        assert clock.idle_for() == 0.0
        jobs["a"].finish()
        await_phase(b, pb.JOB_PHASE_RUNNING)
        assert clock.idle_for() == 0.0
        jobs["b"].finish()
        await_phase(b, pb.JOB_PHASE_SUCCEEDED)
        eventually(lambda: clock.idle_for() > 0, "idle once the last job ended")
        d = new(store, "d")
        scheduler.submit(d)
        assert clock.idle_for() == 0.0                 # at once, queued or not
        scheduler.cancel("d", "not wanted either")
        eventually(lambda: clock.idle_for() > 0, "idle once the queue is empty")
    finally:
        scheduler.shutdown("test over", timeout=5)


# ---------------------------------------------------------------- restart

def test_after_a_restart_queued_and_running_jobs_are_lost_and_new_ones_run(tmp_path, jobs):
    state = str(tmp_path / "state")
    old_store = JobStore(state)
    old = Scheduler(jobs)
    a, b = new(old_store, "a"), new(old_store, "b")
    old.submit(a)
    old.submit(b)
    await_phase(a, pb.JOB_PHASE_RUNNING)
    jobs["a"].output(b"step 1\n")
    eventually(lambda: a.log(0).end() > 0, "a's output stored")
    old_store.close()                                     # the agent dies here

    store = JobStore(state)
    try:
        sa, sb = store.get("a").status, store.get("b").status
        assert (sa.phase, sa.end.state) == (pb.JOB_PHASE_LOST, pb.JOB_STATE_LOST)
        assert sa.detail == ("its agent stopped or restarted while the job was running; "
                             "the logs up to then are kept")
        assert (sb.phase, sb.end.state) == (pb.JOB_PHASE_LOST, pb.JOB_STATE_LOST)
        assert sb.detail == ("its agent stopped or restarted while the job was queued; "
                             "the logs up to then are kept")
        assert [d for _, d, _ in store.get("a").log(0).read(0)] == [b"step 1\n"]

        fresh = Jobs()
        scheduler = Scheduler(fresh)
        c = new(store, "c")
        scheduler.submit(c)
        await_phase(c, pb.JOB_PHASE_RUNNING)
        assert queued(c) == (0, "")
        fresh["c"].output(b"fine\n")
        fresh["c"].finish()
        assert await_phase(c, pb.JOB_PHASE_SUCCEEDED).end.state == pb.JOB_STATE_SUCCEEDED
        assert fresh.made == ["c"]
        assert [d for _, d, _ in c.log(0).read(0)] == [b"fine\n"]
        scheduler.shutdown("test over", timeout=5)
        assert store.get("a").status.phase == pb.JOB_PHASE_LOST
    finally:
        old.shutdown("test over", timeout=5)      # its store is closed: writes are dropped
        store.close()
