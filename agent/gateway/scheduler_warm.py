"""The scheduler's part in warm sessions (``gateway.warm``): which job runs in one,
ending one, and a session's next call run in its caller's own thread.

A call of the session's own caller that finds the slice idle (nothing running,
nothing queued) runs at once in the thread that received it (``claim``, then
``Scheduler.run_here``): no hand-off to the scheduler's thread and back, each
a thread's wake-up on the call's way.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from remote_tpu_agent.gateway.job import GatewayJob
from remote_tpu_agent.jobs.store import JobRecord
from remote_tpu_agent.gateway.warm import WarmSession


class WarmScheduling:
    """(Mixed into ``Scheduler``, whose state this reads and sets.)"""

    _cond: threading.Condition
    _warm: WarmSession | None
    _current: tuple[JobRecord, GatewayJob | None] | None
    _end_warm_after: str
    _stopping: bool
    _queue: collections.deque[JobRecord]
    _inline = False           # a job runs in its caller's thread (``claim``)

    def _renumber(self) -> None:
        raise NotImplementedError

    def claim(self, record: JobRecord) -> WarmSession | None:
        """Take the slice for ``record`` at once, to run in the caller's own
        thread (``run_here``): when it is the next call of its caller's warm
        session and nothing else runs or waits. The session; None: submit it."""
        spec = record.spec
        with self._cond:
            warm = self._warm
            if warm is None or self._stopping or self._current is not None or \
                    self._inline or self._queue or not spec.client_id or \
                    warm.owner != spec.client_id or warm.ending or \
                    time.time() >= warm.deadline or spec.HasField("retries"):
                return None
            self._inline = True
            self._current = (record, None)
            return warm

    def release(self, reason: str, owner: str = "") -> str:
        """End the slice's warm workers (at once, or once the call running in
        them is over), only if ``owner``'s when given; what was done, or ""
        when there were none."""
        with self._cond:
            warm, current = self._warm, self._current
            if owner and (warm is None or warm.owner != owner):
                return ""
            if current is not None and (warm is not None or (
                    current[1] is not None and current[1].session_id)):
                # A call runs (or is about to) in warm workers: they end after it.
                self._end_warm_after = reason
                return (f"the warm workers end when the call running in them "
                        f"({current[0].job_id}) is over")
            if warm is None:
                return ""
            self._warm = None
            self._renumber()
            self._cond.notify_all()
        warm.end(reason)
        return f"warm session {warm.id} ended after {warm.calls} call(s)"

    def _usable(self, record: JobRecord, warm: WarmSession | None,
                notices: list[str]) -> WarmSession | None:
        """``warm``, if this job can run in it; else it is ended, and a notice
        for the job's caller says why."""
        if warm is None:
            return None
        differ = warm.differences(record.spec)
        if not differ and warm.alive():
            return warm
        with self._cond:
            self._warm = None
        why = (f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''}" if differ
               else "its workers had exited since the last call")
        warm.end(f"replaced by job {record.job_id}: {why}")
        notices.append(f"the warm workers of {warm.id} were replaced by new ones ({why}); "
                       "remote_tpu.state started empty")
        return None

    def _keep_warm(self, record: JobRecord, job: GatewayJob | None,
                   warm: WarmSession | None, ended_how: str,
                   retrying: bool = False) -> Callable[[], None]:
        """As a job ends (before its caller hears of it): its workers stay as
        the slice's warm session, or the session it ran in is over. Returns
        what is left to do once the caller has been told (stopping workers).
        A job that runs again (``retrying``) stays the current one, to cancel."""
        session = job.kept_session(record.store) if job is not None else None
        with self._cond:
            # release() from here on ends the session
            self._current = (record, None) if retrying else None
            end_now, self._end_warm_after = self._end_warm_after, ""
            if self._stopping:
                end_now = end_now or "the agent is shutting down"
            if session is not None and not end_now:
                session.calls += 1
                session.parked_after(record.spec)
                self._warm = session
                return _nothing
            self._warm = None
        if session is not None:
            session.calls += 1               # this call ran in it before it ends
        ended = session or warm
        if ended is None:
            return _nothing
        return lambda: ended.end(end_now or f"call {record.job_id} ended {ended_how}")


def _nothing() -> None:
    """Nothing left to do."""
