"""Warm sessions (``keep_warm``): a slice's workers kept alive between calls.

After a call with ``keep_warm_seconds`` succeeds on every host, each worker is
parked instead of exiting, ``jax.distributed`` still initialized. The gateway
keeps them as one ``WarmSession``: this host's parked ``WorkerRun`` objects, the
open calls to the peers that keep theirs (``RemoteHost``), the worker-shaping
options they were started with, who called, and until when they stay. The next call of the
same caller with the same options runs in them; a call of the same caller with
other options replaces them; other callers' jobs wait until the session ends
(``Release``, the idle time, a failed call, the agent stopping).

The session is listed among the gateway's jobs (its own record, ``warm-...``,
RUNNING with ``warm_until``), so ``remote-tpu jobs list`` shows who holds the
slice and until when, and ``remote-tpu jobs cancel warm-...`` ends it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.jobs.events import EventQueue
from remote_tpu_agent.gateway.peer_process import RemoteHost
from remote_tpu_agent.worker.run import WorkerRun
from remote_tpu_agent.jobs.store import JobRecord

log = logging.getLogger(__name__)


def new_session_id() -> str:
    return f"warm-{uuid.uuid4().hex[:12]}"


def is_session(record: JobRecord) -> bool:
    """Whether a record is a warm session's entry (its ``warm_until`` stays
    set once it has ended) rather than a job."""
    return record.status.warm_until > 0


def shaping(spec: pb.JobSpec) -> dict[str, object]:
    """What a worker was started with and cannot change between calls."""
    jt = spec.jax_timeouts
    v = spec.client_versions
    return {
        "accelerator": spec.accelerator,
        "hosts": tuple(spec.hosts),
        "env": tuple(sorted(spec.env.items())),
        "processes_per_host": max(1, spec.processes_per_host),
        "jax_timeouts": (jt.initialization_seconds, jt.heartbeat_seconds,
                         jt.shutdown_seconds),
        "devices_per_host": spec.devices_per_host,
        "init_jax": not spec.skip_jax_init,
        "client versions": (v.python, v.cloudpickle, v.remote_tpu),
        "requirements": tuple(spec.requirements),
        "compilation_cache": spec.compilation_cache,     # (read as jax is imported)
    }


class WarmSession:
    """A slice's parked workers, between two calls of one caller."""

    def __init__(self, *, session_id: str, spec: pb.JobSpec, coordinator: str,
                 locals_: Sequence[WorkerRun], remotes: Sequence[RemoteHost],
                 record: JobRecord) -> None:
        self.id = session_id
        self.owner = spec.client_id
        self.shape = shaping(spec)
        self.coordinator = coordinator
        self.locals = list(locals_)
        self.remotes = list(remotes)
        self.record = record
        self.calls = 0
        self.deadline = 0.0
        self.ending = ""          # set: end once the running call is over

    def differences(self, spec: pb.JobSpec) -> list[str]:
        """The worker-shaping options in which ``spec`` differs from the session's."""
        theirs = shaping(spec)
        return [name for name, value in self.shape.items() if theirs[name] != value]

    def alive(self) -> bool:
        """Every worker is still there, parked (a peer's: its call is open)."""
        return all(run.parked and run.alive for run in self.locals) and \
            all(remote.parked for remote in self.remotes)

    def parked_after(self, spec: pb.JobSpec) -> None:
        """A call in the session succeeded: the workers wait its ``keep_warm``
        from now (a call without keep_warm leaves the time as it was). The
        session's record changes in memory only (what lists it reads it there):
        were the agent to die, the session would be lost all the same."""
        if spec.keep_warm_seconds > 0:
            self.deadline = time.time() + spec.keep_warm_seconds
        calls = self.calls
        until = time.strftime("%H:%M:%S", time.localtime(self.deadline))
        with self.record.changed:
            self.record.status.warm_until = self.deadline
            self.record.status.detail = (
                f"warm workers of {self.owner or 'a client'}: {calls} call(s), last "
                f"{spec.job_id}; idle until {until}")
            self.record.touch(wake=False)

    def end(self, reason: str) -> None:
        """Stop every worker of the session, here and on every peer (ending its
        call ends a peer's worker). What this host's workers printed since the
        last call goes to the session's own log (a peer's, to that host's own
        copy of its first call)."""
        for run in self.locals:
            for stream, data in run.parked_output() if run.parked else []:
                try:
                    self.record.append_output(run.host, stream, data)
                except OSError as exc:
                    log.error("warm session %s: cannot keep its output: %s", self.id, exc)
                    break
        for handle in [*self.locals, *self.remotes]:
            handle.stop()
        self.record.set_phase(pb.JOB_PHASE_SUCCEEDED, f"{reason} after {self.calls} call(s)",
                              pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED, root_cause_host=-1,
                                        detail=reason))
        log.info("warm session %s ended: %s", self.id, reason)


class ParkedWakes:
    """Where a warm call's events go: its job's queue. A host that parked (its
    `done` and `exited`, warm) after its function returned wakes the job's
    thread only as the last of the ``n`` to park: until then that thread has
    nothing to do. One that raised wakes it at once (fail-fast)."""

    def __init__(self, events: EventQueue, n: int) -> None:
        self._events = events
        self._n = n
        self._parked = 0
        self._lock = threading.Lock()

    def __call__(self, event: pb.Event) -> None:
        report = event.exited if event.HasField("exited") else (
            event.done if event.HasField("done") else None)
        if report is None or not report.warm:
            self._events.put(event)
            return
        with self._lock:
            self._parked += event.HasField("exited")
            last = self._parked >= self._n
        self._events.put(event, wake=last or report.state != pb.HOST_STATE_SUCCEEDED)


def session_record(store, spec: pb.JobSpec, session_id: str) -> JobRecord:
    """The session's own entry among the gateway's jobs."""
    mine = pb.JobSpec(job_id=session_id, accelerator=spec.accelerator,
                      num_hosts=spec.num_hosts, hosts=spec.hosts, client_id=spec.client_id,
                      processes_per_host=spec.processes_per_host)
    record, _ = store.create(mine, pb.ROLE_GATEWAY)
    record.set_phase(pb.JOB_PHASE_RUNNING, "warm workers starting")
    return record
