"""The peer role: this host's part of a job some gateway runs.

A gateway sends each of its peers one ``Run`` call per JAX process that host
runs (``role = PEER``). The peer receives the payload, starts the worker, and
streams its output and exit back; it obeys the gateway's controls on the same
call (release: the worker may exit; cancel: stop it). A host runs one job's
workers at a time; when the gateway's call ends early, the worker is stopped.

In a warm session (``keep_warm``) the worker outlives the call: parked once the
gateway releases it, handed the session's next call, and stopped when the
gateway ends the session (``Release``), when a call in it fails, or, should
the gateway never say, a while after the session's idle time has passed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import phase_of_host

from . import _worker
from ._events import EventQueue
from ._hostlog import StoreFull
from ._requests import Refused, abort
from ._runner import WorkerRun
from ._store import JobRecord, JobStore
from ._tpu import TpuBusy, TpuGuard
from ._uploads import Uploads

log = logging.getLogger(__name__)

STREAMS = 64          # calls from gateways at once: one per process of this host's job
# A parked warm worker whose gateway never ended its session (the gateway died)
# is stopped this long after the session's own idle time.
_ORPHAN_GRACE_SECONDS = 60.0


class PeerRole:
    def __init__(self, *, store: JobStore, uploads: Uploads, tpu: TpuGuard,
                 endpoint: Callable[[], str],
                 env_for: Callable[[pb.JobSpec, int, str], dict[str, str]],
                 preempted: Callable[[], bool]) -> None:
        self._store = store
        self._uploads = uploads
        self._tpu = tpu
        self._endpoint = endpoint
        self._env_for = env_for
        self._preempted = preempted
        # A host runs one job's workers at a time (several when processes_per_host > 1).
        self._slot = threading.Condition()
        self._job = ""
        self._count = 0
        self._runs: dict[tuple[str, int], WorkerRun] = {}
        # Warm workers by (session, process id), parked between calls.
        self._warm: dict[tuple[str, int], WorkerRun] = {}
        self._warm_lock = threading.Lock()

    def stacks(self, job_id: str) -> list[pb.HostStacks] | None:
        """This host's workers' stacks in ``job_id``, or None when it runs none."""
        runs = [run for (job, _), run in list(self._runs.items()) if job == job_id]
        return [pb.HostStacks(host=run.host, text=run.stacks()) for run in runs] or None

    def stop_all(self) -> None:
        self.release("")
        for run in list(self._runs.values()):
            run.stop()

    def release(self, session: str) -> int:
        """Stop the warm workers of ``session`` ("" = every session); how many."""
        with self._warm_lock:
            keys = [key for key in self._warm if session in ("", key[0])]
            runs = [self._warm.pop(key) for key in keys]
        for run in runs:
            run.stop()
        if runs:
            log.info("warm session %s: %d worker(s) stopped", session or "(all)", len(runs))
            self._tpu.release()
        return len(runs)

    def _warm_run(self, spec: pb.JobSpec, job_dir: str, env: dict[str, str],
                  emit) -> tuple[WorkerRun, bool]:
        """The session's parked worker for this process, or a new warm one;
        whether it is new (to be started)."""
        key = (spec.warm_session, spec.process_id)
        with self._warm_lock:
            run = self._warm.get(key)
            if spec.warm_call > 1:
                if run is not None and run.next_call(job_dir=job_dir, env=env, emit=emit):
                    return run, False
                self._warm.pop(key, None)
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "warm",
                              f"the warm worker of process {spec.process_id} on host "
                              f"{self._endpoint()} is gone (it exited between calls, or its "
                              "agent restarted)")
            run = WorkerRun(host=spec.process_id, job_dir=job_dir, env=env, emit=emit,
                            forward_output=True, warm=True)
            self._warm[key] = run
            return run, True

    def _park_watch(self, spec: pb.JobSpec, run: WorkerRun) -> None:
        """Stop a parked worker that no call and no Release reach in time."""
        calls = run.calls

        def expire() -> None:
            key = (spec.warm_session, spec.process_id)
            with self._warm_lock:
                if self._warm.get(key) is not run or run.calls != calls or not run.parked:
                    return
                del self._warm[key]
            log.warning("warm session %s: no word from its gateway; stopping process %d",
                        spec.warm_session, spec.process_id)
            run.stop()
        timer = threading.Timer(spec.keep_warm_seconds + _ORPHAN_GRACE_SECONDS, expire)
        timer.daemon = True
        timer.start()

    def run(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
            context: grpc.ServicerContext) -> Iterator[pb.Event]:
        """This host's part of a gateway's job: one worker, obeying the gateway."""
        with self._slot:
            free = self._slot.wait_for(
                lambda: self._count == 0 or self._job == spec.job_id, timeout=5)
            if not free:
                abort(context, Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                    f"host {self._endpoint()} is still running job {self._job}'s worker"))
            self._job = spec.job_id
            self._count += 1
        mine = pb.JobSpec()
        mine.CopyFrom(spec)
        mine.job_id = f"{spec.job_id}.p{spec.process_id}"     # this process's own record
        try:
            record, created = self._store.create(mine, pb.ROLE_PEER)
            if not created:
                abort(context, Refused(grpc.StatusCode.ALREADY_EXISTS, "protocol",
                                       f"job {spec.job_id} already ran on this host"))
            self._uploads.receive(spec, requests,
                                  os.path.join(record.dir, _worker.PAYLOAD_FILE), context)
            try:
                self._tpu.prepare()
            except TpuBusy as exc:
                record.set_phase(pb.JOB_PHASE_FAILED, str(exc))
                abort(context, Refused(grpc.StatusCode.FAILED_PRECONDITION, "busy",
                                       f"host {self._endpoint()}: {exc}"))
            record.set_phase(pb.JOB_PHASE_RUNNING)
            yield from self._events(spec, requests, record, context)
        finally:
            try:
                os.unlink(os.path.join(self._store.get(mine.job_id, pb.ROLE_PEER).dir,
                                       _worker.PAYLOAD_FILE))
            except (OSError, AttributeError):
                pass
            with self._slot:
                self._count -= 1
                if not self._count:
                    self._job = ""
                self._slot.notify_all()

    def _events(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
                record: JobRecord, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        events = EventQueue()
        env = self._env_for(spec, spec.process_id, spec.coordinator_address)
        if spec.warm_session:
            try:
                run, new = self._warm_run(spec, record.dir, env, events.put)
            except Refused as refused:
                record.set_phase(pb.JOB_PHASE_FAILED, refused.message)
                abort(context, refused)
        else:
            run, new = WorkerRun(host=spec.process_id, job_dir=record.dir, env=env,
                                 emit=events.put, forward_output=True), True

        def obey() -> None:
            try:
                for req in requests:
                    if req.control == pb.CONTROL_RELEASE:
                        run.release()
                    elif req.control == pb.CONTROL_CANCEL:
                        threading.Thread(target=run.cancel, daemon=True).start()
                    else:
                        log.warning("job %s: ignoring unexpected request %s", spec.job_id,
                                    req.WhichOneof("kind") or f"control {req.control}")
            except grpc.RpcError:
                pass
            except Exception:  # noqa: BLE001 - the stream ended under us
                log.debug("control stream ended", exc_info=True)

        def on_done() -> None:
            if not run.finished.is_set():
                threading.Thread(target=run.cancel, daemon=True).start()
            events.put(None)
        context.add_callback(on_done)
        log.info("job %s: host %d, coordinator %s", spec.job_id, spec.process_id,
                 spec.coordinator_address)
        self._runs[(spec.job_id, spec.process_id)] = run
        final = pb.JOB_PHASE_LOST
        try:
            if new:
                run.start()
            threading.Thread(target=obey, daemon=True, name="peer-control").start()
            while True:
                event = events.get()
                if event is None:
                    return
                if event.HasField("output"):
                    try:     # this host's own copy; the gateway keeps the job's
                        record.append_output(event.host, event.output.stream,
                                             event.output.data)
                    except StoreFull as exc:
                        log.error("job %s: %s", spec.job_id, exc.strerror)
                if event.HasField("exited") and event.exited.state != pb.HOST_STATE_SUCCEEDED:
                    event.exited.preempted = self._preempted()
                yield event
                if event.HasField("exited"):
                    final = phase_of_host(event.exited.state)
                    if event.exited.preempted:
                        final = pb.JOB_PHASE_PREEMPTED
                    return
        finally:
            events.close()
            run.close()
            run.finished.wait(5)
            self._runs.pop((spec.job_id, spec.process_id), None)
            if run.parked:
                self._park_watch(spec, run)
            else:
                with self._warm_lock:
                    if self._warm.get((spec.warm_session, spec.process_id)) is run:
                        del self._warm[(spec.warm_session, spec.process_id)]
                self._tpu.release()
            record.set_phase(final, "" if final != pb.JOB_PHASE_LOST else
                             "the gateway went away before this host finished")
