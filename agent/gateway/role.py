"""The gateway role: this host takes a job from a client for its slice.

It checks where the job may run (the client's host list or this slice's peers,
against the accelerator), receives the payload once, queues the job in its
store, and runs it when its turn comes as a ``GatewayJob`` (``gateway.job``):
its own worker first, then every peer, events merged, fail-fast. An attached
caller follows the job's output and gets its outcome; its job does not outlive it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Iterator

import grpc

from remote_tpu._core.channels import ERROR_KIND_KEY
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.gateway.job import GatewayJob
from remote_tpu_agent.gateway.scheduler import Scheduler
from remote_tpu_agent.gateway.warm import WarmSession
from remote_tpu_agent.host.config import AgentConfig
from remote_tpu_agent.host.envs import EnvError
from remote_tpu_agent.host.preparing import NotPrepared, Prepared
from remote_tpu_agent.host.shared import Host
from remote_tpu_agent.host.working_dirs import place_job, refs_of
from remote_tpu_agent.jobs.requests import Refused, abort, hosts_for
from remote_tpu_agent.jobs.store import JobRecord
from remote_tpu_agent.jobs.views import result as result_events
from remote_tpu_agent.jobs.views import status_of, watch
from remote_tpu_agent.wire.caller_lane import RESEND_SECONDS
from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.worker.environment import num_processes, processes_per_host
from remote_tpu_agent.worker.frames import INLINE_BYTES
from remote_tpu_agent.worker.processes import Children

log = logging.getLogger(__name__)


class GatewayRole:
    def __init__(self, *, config: AgentConfig, host: Host, advertise: str) -> None:
        self._config = config
        self._host = host
        self._advertise = advertise
        self.scheduler = Scheduler(self._make_job, config.output_interval, host.idle)

    def accept(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
               context: grpc.ServicerContext, submit: bool = True
               ) -> tuple[JobRecord, bool]:
        """Queue a new job (``submit``; else its caller does), or find the one
        with this id (idempotent submission)."""
        existing = self._host.store.get(spec.job_id)
        if existing is not None:
            return existing, False
        if self._host.idle.done:                  # (--idle-delete: the VM goes soon)
            abort(context, Refused(
                grpc.StatusCode.FAILED_PRECONDITION, "deleted",
                f"the slice of {self._host.endpoint()} is being deleted: it was idle for "
                f"{self._config.idle_delete_minutes:g} min (--idle-delete) and the Cloud TPU "
                "API took the request; make another (remote-tpu up)"))
        try:
            hosts = hosts_for(spec, self._config.slice, self._host.endpoint())
            self._check_python(spec)
        except Refused as r:
            abort(context, r)
        path = self._host.uploads.new_file(spec.job_id) if spec.payload_size > INLINE_BYTES else ""
        try:
            with self._host.idle.hold():           # (a large payload may take a while)
                payload = self._host.uploads.receive(spec, requests, path, context)
            spec.num_hosts = len(hosts)
            spec.hosts[:] = hosts
            # (Not yet written when its caller may run it at once: then its
            # first write says RUNNING. run_attached writes it otherwise.)
            record, created = self._host.store.create(spec, pb.ROLE_GATEWAY, save=submit)
            if created and spec.earlier_attempts:     # a caller's own retries= before it
                with record.changed:
                    record.status.attempts.extend(spec.earlier_attempts[-200:])
                self._host.store.save(record)
            if created and refs_of(spec):
                self._pin_blobs(record, context)
            if created:
                if isinstance(payload, bytes):
                    record.payload = payload
                else:
                    record.payload = os.path.join(record.make_dir(), _worker.PAYLOAD_FILE)
                    os.replace(path, record.payload)
                if submit:
                    self.scheduler.submit(record)
                    log.info("job %s: queued (%d host(s))", spec.job_id, len(hosts))
            return record, created
        finally:
            if path and os.path.exists(path):
                os.unlink(path)

    def _check_python(self, spec: pb.JobSpec) -> None:
        """A client on another Python needs an interpreter of its version here
        (``host.pythons``): refused at once, before its payload comes, when none."""
        pythons = self._host.envs.pythons
        wanted = pythons.wanted(spec.client_versions)
        if wanted is not None:
            try:
                pythons.interpreter(wanted[0])
            except EnvError as exc:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "version",
                              f"the agent at {self._host.endpoint()}: {exc}") from None

    def _pin_blobs(self, record: JobRecord, context: grpc.ServicerContext) -> None:
        """Keep the job's large buffers in the cache until it is over; a job
        whose buffers are not all here fails at once (nothing has run)."""
        refs = refs_of(record.spec)
        cache = self._host.blobs
        paths = cache.pin(refs)
        if paths is not None:
            record.blob_paths = paths
            record.unpin = lambda: cache.unpin(refs)
            return
        too_small = cache.too_small(refs)
        why = (f"the agent at {self._host.endpoint()}: {too_small}; nothing was run"
               if too_small else
               f"{len(cache.missing(refs))} of the call's {len(refs)} large argument "
               f"buffer(s) are not in the argument cache of the agent at "
               f"{self._host.endpoint()} (sent too long ago and evicted, or never sent): "
               "nothing was run; call again, which sends them")
        record.set_phase(pb.JOB_PHASE_FAILED, why, pb.JobEnd(
            state=pb.JOB_STATE_FAILED, root_cause_host=-1, detail=why))
        context.set_trailing_metadata(((ERROR_KIND_KEY, "blobs-missing"),))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)

    def run_attached(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
                     context: grpc.ServicerContext) -> Iterator[pb.Event]:
        """Accept the job and follow it: queued notice, output, outcome. The
        next call of its caller's warm session, finding the slice idle, runs
        in this thread (``Scheduler.claim``)."""
        record, created = self.accept(spec, requests, context, submit=False)
        record.attached = True
        with record.changed:
            record.followers += 1
        done = threading.Event()

        def on_done() -> None:        # an attached job does not outlive its callers
            if done.is_set():
                return
            done.set()
            with record.changed:
                record.followers -= 1
                if record.finished or record.followers:
                    return
            if getattr(context, "broken", False):      # a lane's: its call may come again
                timer = threading.Timer(RESEND_SECONDS, self._cancel_unfollowed, (record,))
                timer.daemon = True
                timer.start()
            else:
                self.scheduler.cancel(record.job_id, "the attached caller went away")
        hosts = {pb.STREAM_MODE_ALL: list(range(num_processes(record.spec))),
                 pb.STREAM_MODE_NONE: []}.get(spec.stream, [0])
        warm = self.scheduler.claim(record) if created else None   # (run at once below)
        if created and warm is None:
            self._host.store.save(record)
            self.scheduler.submit(record)
            log.info("job %s: queued (%d host(s))", spec.job_id, spec.num_hosts)
        # Once the scheduler has the job: for a caller gone before this (a lane
        # closed right after its call) ``on_done`` runs now, and its cancel finds
        # the job (before the job was the scheduler's, that cancel was lost, and
        # a call with nobody attached ran on). gRPC's add_callback does not run
        # a callback for a call already over: it says so.
        if not context.add_callback(on_done):
            on_done()
        status = status_of(record)
        if warm is None and status.phase == pb.JOB_PHASE_QUEUED and status.queued_behind:
            yield pb.Event(host=0, queued=status)
        try:
            if warm is not None:
                self._start_here(record, warm)
            yield from watch(record, hosts, [], follow=True, context=context, with_end=False,
                             metrics=lambda: self.scheduler.metrics(record.job_id))
            yield from result_events(record, self._host.data_port()
                                     if spec.result_over_data_port else None,
                                     spec.value_in_end)
        finally:
            if not record.result_ticketed:     # else the ticket's transfer says so
                record.result_sent()

    def _cancel_unfollowed(self, record: JobRecord) -> None:
        """A lane broke under this job's call and no resend of it came."""
        with record.changed:
            if record.finished or record.followers:
                return
        self.scheduler.cancel(record.job_id, "the lane to its attached caller broke and no "
                              f"resend of the call came within {RESEND_SECONDS:g} s: "
                              "the caller went away")

    def _start_here(self, record: JobRecord, warm: WarmSession) -> None:
        """Run a claimed job in this thread for as long as it makes nothing to
        send (a warm call that prints nothing: most); from its first output
        on, it goes on in a thread of its own, and this one follows it as any
        (``watch``): a job never waits for its caller to read."""
        job = self.scheduler.run_here(record, warm)
        for _ in job:
            threading.Thread(target=collections.deque, args=(job, 0), daemon=True,
                             name=f"job-{record.job_id}").start()
            break

    def _make_job(self, record: JobRecord, warm: WarmSession | None) -> GatewayJob:
        spec = record.spec
        return GatewayJob(spec=spec, hosts=list(spec.hosts), job_dir=record.dir,
                          payload=record.payload,
                          prepare=lambda children, coordinator: self._prepare(
                              record, children, coordinator),
                          blobs=self._host.blobs,
                          advertise=self._advertise,
                          peer_credentials=self._config.peer_credentials,
                          tpu=self._host.tpu,
                          preempted=self._host.preempted, warm=warm,
                          spares=self._host.spares)

    def _prepare(self, record: JobRecord, children: Children, coordinator: str) -> Prepared:
        """This host's part of the job made ready (in the job, its processes
        as ``children``: ``GatewayJob``); NotPrepared says why it cannot be."""
        spec = record.spec
        try:
            call_paths, tree, data = place_job(self._host.workdirs, spec, record.blob_paths)
            extra = self._host.envs.for_job(spec, self._host.simulated,
                                            lambda line: record.say(0, line), children)
            envs = [{**self._host.env_for(spec, k, coordinator), **extra}
                    for k in range(processes_per_host(spec))]
        except (OSError, ValueError, EnvError) as exc:
            raise NotPrepared(f"host 0 ({self._host.endpoint()}) could not prepare the job: "
                              f"{exc}") from exc
        return Prepared(envs=envs, blob_paths=call_paths, working_dir=tree, data=data)
