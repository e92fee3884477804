"""One job at a time on a slice, first come first served.

The gateway agent owns the queue. Each job runs in this module's thread (its
preparation, installs included, in one of its own: ``host.preparing``); its events
go to the job store (every host's output, then the final state), where
watchers, attached callers and later `attach` calls read them.

A warm session (``gateway.warm``) holds the slice between the calls of one caller:
that caller's next job runs first, in the session's workers (or replaces them
when its worker-shaping options differ); everyone else's jobs wait until the
session ends: released, idle past its time, or a call in it failed.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import PHASE_OF_END, phase_name

from remote_tpu_agent.jobs.attempts import next_attempt
from remote_tpu_agent.gateway.job import GatewayJob
from remote_tpu_agent.jobs.host_log import StoreFull
from remote_tpu_agent.gateway.stalls import STALLS_KEPT
from remote_tpu_agent.host.idle import IdleClock
from remote_tpu_agent.host.output_dir import OutputSync
from remote_tpu_agent.gateway.reports import bound_end
from remote_tpu_agent.jobs.store import JobRecord
from remote_tpu_agent.gateway.scheduler_warm import WarmScheduling
from remote_tpu_agent.gateway.warm import WarmSession
from remote_tpu_agent.worker.environment import processes_per_host

log = logging.getLogger(__name__)


class Scheduler(WarmScheduling):
    """One job at a time on the slice, first come first served (see the
    module's docstring); warm sessions' part: ``WarmScheduling``.

    Why over 200 lines: the queue, a job's cancel wherever it is (queued,
    preparing, running, between attempts) and the serving loop share one lock
    and one notion of "the job now"; the retries' back-off is a few lines of it.
    """

    def __init__(self, make_job: Callable[[JobRecord, WarmSession | None], GatewayJob],
                 output_interval: float = 30.0, idle: IdleClock | None = None) -> None:
        self._make_job = make_job
        self._output_interval = output_interval      # output_dir= uploads (host.output_dir)
        self._idle = idle or IdleClock.never()       # told whenever the slice is busy or not
        self._queue: collections.deque[JobRecord] = collections.deque()
        self._cond = threading.Condition()
        self._current: tuple[JobRecord, GatewayJob | None] | None = None
        # Cancelled between leaving the queue and starting: (reason, state).
        self._early_cancel: tuple[str, int] | None = None
        self._stopping = False
        self._warm: WarmSession | None = None
        self._end_warm_after = ""   # release() while a warm call runs: end it after
        self._lost: dict[str, str] = {}   # callers whose session died between calls: why
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")
        self._thread.start()

    def submit(self, record: JobRecord) -> None:
        with self._cond:
            self._queue.append(record)
            self._renumber()
            self._cond.notify_all()

    def _renumber(self) -> None:
        """Each queued job's place. A warm session's own caller goes first.
        (Called after every change of who holds or waits for the slice: the
        idle clock hears here whether any does.)"""
        self._idle.note(bool(self._queue or self._current or self._warm or self._inline))
        warm = self._warm if self._current is None else None
        mine = [r for r in self._queue if warm and r.spec.client_id == warm.owner]
        others = [r for r in self._queue if not (warm and r.spec.client_id == warm.owner)]
        ahead = self._current[0].job_id if self._current else (
            warm.id if warm and not mine else "")
        for i, record in enumerate(mine + others):
            with record.changed:
                record.status.queue_position = i + 1
                record.status.queued_behind = ahead
                record.touch(wake=False)
            ahead = record.job_id

    def warm_owner(self) -> str:
        """Whose warm session holds the slice now ("" when none does)."""
        warm = self._warm
        return warm.owner if warm is not None else ""

    def cancel(self, job_id: str, reason: str, state: int = pb.JOB_STATE_CANCELLED) -> bool:
        """Cancel a queued or running job; False if this scheduler does not have it."""
        if self._warm is not None and self._warm.id == job_id:
            return bool(self.release(reason))
        with self._cond:
            for record in self._queue:
                if record.job_id == job_id:
                    self._queue.remove(record)
                    self._renumber()
                    break
            else:
                if self._current and self._current[0].job_id == job_id:
                    job = self._current[1]
                    if job is not None:
                        job.cancel(reason, state)
                    else:
                        self._early_cancel = (reason, state)
                        self._cond.notify_all()      # a job waiting between attempts
                    return True
                return False
        record.set_phase(PHASE_OF_END[state], reason, pb.JobEnd(
            state=state, root_cause_host=-1, detail=f"{reason} (while queued)"))
        _drop_payload(record)
        return True

    def interrupt(self, job_id: str, reason: str) -> bool:
        """KeyboardInterrupt in a running job's function on every host
        (``GatewayJob.interrupt``); a job not running yet is cancelled. False
        if this scheduler does not have it."""
        with self._cond:
            current = self._current
        if current and current[0].job_id == job_id and current[1] is not None:
            current[1].interrupt()
            return True
        return self.cancel(job_id, reason)

    def metrics(self, job_id: str) -> list[pb.HostMetrics]:
        """The running job's metrics now (none if it is not running here)."""
        with self._cond:
            current = self._current
        if current and current[0].job_id == job_id and current[1] is not None:
            return current[1].metrics.snapshot()
        return []

    def stacks(self, job_id: str) -> list[pb.HostStacks] | None:
        with self._cond:
            current = self._current
        if current and current[0].job_id == job_id and current[1] is not None:
            return current[1].stacks()
        return None

    def shutdown(self, reason: str, state: int = pb.JOB_STATE_CANCELLED,
                 timeout: float = 8.0) -> None:
        with self._cond:
            self._stopping = True
            queued = list(self._queue)
            current = self._current
            self._cond.notify_all()
        for record in queued:
            self.cancel(record.job_id, reason, state)
        if current is not None:
            self.cancel(current[0].job_id, reason, state)
        self._thread.join(timeout)

    def _next(self) -> tuple[JobRecord | None, WarmSession | None, str]:
        """(With ``_cond`` held.) The next job and the warm session it may run
        in; or no job and a session to end, with why; or (None, None, "") to stop."""
        while True:
            if self._inline:            # a job runs in its caller's thread: after it
                self._cond.wait(1.0)
                continue
            warm = self._warm
            if warm is not None:
                why = warm.ending or ("the agent is shutting down" if self._stopping else "")
                if not why and time.time() >= warm.deadline:
                    why = "released: idle for its keep_warm time"
                if not why and not warm.alive():
                    why = "a worker of it exited between calls"
                    self._lost[warm.owner] = (
                        f"the warm workers of {warm.id} were stopped ({why}): this call "
                        "started in fresh workers, and remote_tpu.state started empty")
                if why:
                    self._warm = None
                    return None, warm, why
                for record in self._queue:
                    if record.spec.client_id and record.spec.client_id == warm.owner:
                        self._queue.remove(record)
                        return record, warm, ""
                # Woken by a job, a release, or at the deadline; and every
                # second, to see that every worker is still there.
                self._cond.wait(min(1.0, max(0.01, warm.deadline - time.time())))
                continue
            if self._queue:
                return self._queue.popleft(), None, ""
            if self._stopping:
                return None, None, ""
            self._cond.wait()

    def _loop(self) -> None:
        while True:
            with self._cond:
                record, warm, why = self._next()
                if record is not None:
                    self._current = (record, None)
                self._renumber()
            if record is None:
                if warm is None:
                    return
                warm.end(why)
                with self._cond:
                    self._renumber()
                continue
            for _ in self._serve(record, warm):
                pass

    def run_here(self, record: JobRecord, warm: WarmSession) -> Iterator[None]:
        """Run a job ``claim`` took in this (its caller's) thread: yields once
        each of its events is stored, for the caller to send on what is new."""
        yield from self._serve(record, warm, here=True)

    def _serve(self, record: JobRecord, warm: WarmSession | None,
               here: bool = False) -> Iterator[None]:
        """Run one job (and its retries), yielding once each event is stored."""
        try:
            yield from self._run(record, warm)
            while record.retry_in is not None and self._backoff(record):
                record.spec.attempt += 1          # REMOTE_TPU_ATTEMPT (worker.environment)
                yield from self._run(record, None)
        except Exception as exc:  # noqa: BLE001 - a job must never stop the queue
            log.exception("job %s: internal error", record.job_id)
            record.set_phase(pb.JOB_PHASE_FAILED, f"internal error in the agent: {exc}",
                             pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=-1,
                                       detail=f"internal error in the agent: {exc}"))
        finally:
            with self._cond:
                # (Once a warm call has ended, the session's next may already
                # have claimed the slice: what is its own stays.)
                if self._current is not None and self._current[0] is record:
                    self._current = None
                    self._early_cancel = None     # this job's, never the next one's
                if here:
                    self._inline = False
                    if self._queue or self._stopping:      # (else its next look will do)
                        self._cond.notify_all()
                self._renumber()
            _drop_payload(record)

    def _backoff(self, record: JobRecord) -> bool:
        """Wait out the pause before the job's next attempt; False (the job
        ended cancelled) when it is cancelled, or the agent stops, meanwhile."""
        delay, record.retry_in = record.retry_in or 0.0, None
        deadline = time.monotonic() + delay
        with self._cond:
            self._current = (record, None)
            while True:
                early, self._early_cancel = self._early_cancel, None
                if early is None and self._stopping:
                    early = ("the agent is shutting down", pb.JOB_STATE_CANCELLED)
                left = deadline - time.monotonic()
                if early is not None or left <= 0:
                    break
                self._cond.wait(left)
        if early is None:
            return True
        reason, state = early
        detail = f"{reason} (between attempts {record.spec.attempt} and " \
                 f"{record.spec.attempt + 1})"
        record.set_phase(PHASE_OF_END[state], detail, pb.JobEnd(
            state=state, root_cause_host=-1, detail=detail))
        return False

    def _run(self, record: JobRecord, warm: WarmSession | None = None) -> Iterator[None]:
        notices: list[str] = []
        with self._cond:
            lost = self._lost.pop(record.spec.client_id, "")
        if lost:
            notices.append(lost)
        warm = self._usable(record, warm, notices)
        job = None
        kept = False
        try:
            job = self._make_job(record, warm)
            kept = yield from self._follow(record, job, warm, notices)
        finally:
            if not kept:
                self._keep_warm(record, job, warm, "without a final report")()

    def _follow(self, record: JobRecord, job: GatewayJob, warm: WarmSession | None,
                notices: list[str]) -> Iterator[None]:
        """Store the job's events (yielding after each); returns whether its
        end was seen (and the warm session settled before its caller heard of it)."""
        ended = False
        with self._cond:
            self._current = (record, job)
            early, self._early_cancel = self._early_cancel, None
            if self._stopping and early is None:
                early = ("the agent is shutting down", pb.JOB_STATE_CANCELLED)
        if early is not None:
            job.cancel(*early)
        record.set_phase(pb.JOB_PHASE_RUNNING, f"attempt {record.spec.attempt}"
                         if record.spec.attempt else "")
        log.info("job %s: running on %d host(s)", record.job_id, job.n)
        outputs = OutputSync(record.spec, record.store.state_dir,   # this host's processes
                             list(range(processes_per_host(record.spec))),
                             record.say, self._output_interval).start()
        try:
            record.workers_started = 0
            for event in job.run():
                if event.HasField("started"):
                    record.worker_started()
                    yield
                elif event.HasField("stall"):
                    record.add_stall(event.stall, STALLS_KEPT)
                    yield
                elif event.HasField("output"):
                    try:
                        record.append_output(event.host, event.output.stream, event.output.data)
                    except StoreFull as exc:
                        log.error("job %s: %s", record.job_id, exc.strerror)
                        job.cancel(exc.strerror, pb.JOB_STATE_FAILED)
                    yield
                elif event.HasField("end"):
                    end = bound_end(event.end, record.job_id)
                    end.notices.extend(notices + outputs.finish() +
                                       [n for r in end.hosts for n in r.notices])
                    dropped = record.dropped_output()
                    if dropped:
                        end.detail = (f"{end.detail}; " if end.detail else "") + (
                            f"{dropped:,} bytes of output could not be stored: "
                            f"{record.store.full_message()}")
                    record.retry_in = next_attempt(record, end)
                    finish = self._keep_warm(record, job, warm,
                                             phase_name(PHASE_OF_END[end.state]),
                                             retrying=record.retry_in is not None)
                    ended = True
                    if record.retry_in is not None:     # retries=: not over yet
                        record.set_phase(pb.JOB_PHASE_RUNNING,
                                         f"attempt {record.spec.attempt} ended by a "
                                         f"{record.status.attempts[-1].kind}: retrying")
                        finish()
                        continue
                    if end.state == pb.JOB_STATE_SUCCEEDED:
                        record.keep_result(*job.result_data())
                    record.set_phase(PHASE_OF_END[end.state], end.detail, end)
                    finish()
                    log.info("job %s: %s", record.job_id, phase_name(PHASE_OF_END[end.state]))
        finally:
            outputs.finish()           # (a job that ended without its report)
        return ended


def _drop_payload(record: JobRecord) -> None:
    """A job that will not run (again) needs its payload no more."""
    unpin, record.unpin = record.unpin, None
    if unpin is not None:
        unpin()
    if isinstance(record.payload, str):
        try:
            os.unlink(record.payload)
        except OSError:
            pass
    record.payload = b""
