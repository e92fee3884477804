"""One job at a time on a slice, first come first served.

The gateway agent owns the queue. Each job runs in this module's thread; its
events go to the job store (every host's output, then the final state), where
watchers, attached callers and later `attach` calls read them.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import PHASE_OF_END

from . import _worker
from ._gateway_job import GatewayJob
from ._hostlog import StoreFull
from ._reports import bound_end
from ._store import JobRecord

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, make_job: Callable[[JobRecord], GatewayJob]) -> None:
        self._make_job = make_job
        self._queue: collections.deque[JobRecord] = collections.deque()
        self._cond = threading.Condition()
        self._current: tuple[JobRecord, GatewayJob | None] | None = None
        # Cancelled between leaving the queue and starting: (reason, state).
        self._early_cancel: tuple[str, int] | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")
        self._thread.start()

    def submit(self, record: JobRecord) -> None:
        with self._cond:
            self._queue.append(record)
            self._renumber()
            self._cond.notify_all()

    def _renumber(self) -> None:
        ahead = self._current[0].job_id if self._current else ""
        for i, record in enumerate(self._queue):
            with record.changed:
                record.status.queue_position = i + 1
                record.status.queued_behind = ahead
                record.touch()
            ahead = record.job_id

    def cancel(self, job_id: str, reason: str, state: int = pb.JOB_STATE_CANCELLED) -> bool:
        """Cancel a queued or running job; False if this scheduler does not have it."""
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
                    return True
                return False
        record.set_phase(PHASE_OF_END[state], reason, pb.JobEnd(
            state=state, root_cause_host=-1, detail=f"{reason} (while queued)"))
        return True

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

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._queue:
                    return
                record = self._queue.popleft()
                self._current = (record, None)
                self._renumber()
            try:
                self._run(record)
            except Exception as exc:  # noqa: BLE001 - a job must never stop the queue
                log.exception("job %s: internal error", record.job_id)
                record.set_phase(pb.JOB_PHASE_FAILED, f"internal error in the agent: {exc}",
                                 pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=-1,
                                           detail=f"internal error in the agent: {exc}"))
            finally:
                with self._cond:
                    self._current = None
                    self._renumber()
                try:
                    os.unlink(os.path.join(record.dir, _worker.PAYLOAD_FILE))
                except OSError:
                    pass

    def _run(self, record: JobRecord) -> None:
        job = self._make_job(record)
        with self._cond:
            self._current = (record, job)
            early, self._early_cancel = self._early_cancel, None
            if self._stopping and early is None:
                early = ("the agent is shutting down", pb.JOB_STATE_CANCELLED)
        if early is not None:
            job.cancel(*early)
        record.set_phase(pb.JOB_PHASE_RUNNING)
        log.info("job %s: running on %d host(s)", record.job_id, job.n)
        for event in job.run():
            if event.HasField("output"):
                try:
                    record.append_output(event.host, event.output.stream, event.output.data)
                except StoreFull as exc:
                    log.error("job %s: %s", record.job_id, exc.strerror)
                    job.cancel(exc.strerror, pb.JOB_STATE_FAILED)
            elif event.HasField("end"):
                end = bound_end(event.end, record.job_id)
                dropped = record.dropped_output()
                if dropped:
                    end.detail = (f"{end.detail}; " if end.detail else "") + (
                        f"{dropped:,} bytes of output could not be stored: "
                        f"{record.store.full_message()}")
                record.set_phase(PHASE_OF_END[end.state], end.detail, end)
                log.info("job %s: %s", record.job_id, pb.JobState.Name(end.state))
