"""The peer role: this host's part of a job some gateway runs.

A gateway sends each of its peers one ``Run`` call per JAX process that host
runs (``role = PEER``). The peer receives the payload, starts the worker, and
streams its output and exit back; it obeys the gateway's controls on the same
call (release: the worker may exit; cancel: stop it). A host runs one job's
workers at a time; when the gateway's call ends, the worker is stopped.

In a warm session (``keep_warm``) that call stays open between calls: once the
function has returned the worker parks (its ``exited`` event says ``warm``),
and the session's next call comes on the same call (``next_call``, then its
payload) and runs in the same worker. The gateway ends the session by ending
the call; a gateway that dies or drops off the network ends it too, since gRPC's
keepalive then ends the call. Each call's own work: ``peer.call``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import grpc

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.host.shared import Host
from remote_tpu_agent.host.tpu import TpuBusy
from remote_tpu_agent.host.working_dirs import refs_of
from remote_tpu_agent.jobs.attempts import run_key
from remote_tpu_agent.jobs.requests import Refused, abort
from remote_tpu_agent.peer.call import PeerCall, pin
from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.worker.run import WorkerRun

log = logging.getLogger(__name__)

STREAMS = 64          # calls from gateways at once: one per process of this host's job


class PeerRole:
    def __init__(self, host: Host) -> None:
        self._host = host
        # A host runs one job's workers at a time (several when processes_per_host > 1).
        self._slot = threading.Condition()
        self._job = ""
        self._count = 0
        self._runs: dict[tuple[str, int], WorkerRun] = {}

    def stacks(self, job_id: str) -> list[pb.HostStacks] | None:
        """This host's workers' stacks in ``job_id``, or None when it runs none."""
        runs = [run for (job, _), run in list(self._runs.items()) if job == job_id]
        return [pb.HostStacks(host=run.host, text=run.stacks()) for run in runs] or None

    def stop_all(self) -> None:
        for run in list(self._runs.values()):
            run.stop()

    def run(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
            context: grpc.ServicerContext) -> Iterator[pb.Event]:
        """This host's part of a gateway's job: one worker, obeying the gateway."""
        with self._slot:
            free = self._slot.wait_for(
                lambda: self._count == 0 or self._job == spec.job_id, timeout=5)
            if not free:
                abort(context, Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                    f"host {self._host.endpoint()} is still running job {self._job}'s worker"))
            self._job = spec.job_id
            self._count += 1
        mine = pb.JobSpec()
        mine.CopyFrom(spec)
        mine.job_id = f"{run_key(spec)}.p{spec.process_id}"   # this process's own record
        mine.ClearField("payload")
        payload_file = ""
        pinned: list[pb.BlobRef] = []      # the current call's large buffers, pinned here
        try:
            record, created = self._host.store.create(mine, pb.ROLE_PEER)
            if not created:
                abort(context, Refused(grpc.StatusCode.ALREADY_EXISTS, "protocol",
                                       f"job {spec.job_id} already ran on this host"))
            payload_file = os.path.join(record.dir, _worker.PAYLOAD_FILE)
            payload = self._host.uploads.receive(spec, requests, payload_file, context)
            try:
                self._host.tpu.prepare()
            except TpuBusy as exc:
                record.set_phase(pb.JOB_PHASE_FAILED, str(exc))
                abort(context, Refused(grpc.StatusCode.FAILED_PRECONDITION, "busy",
                                       f"host {self._host.endpoint()}: {exc}"))
            paths, why = pin(self._host, spec)
            if paths is None:
                record.set_phase(pb.JOB_PHASE_FAILED, why)
                abort(context, Refused(grpc.StatusCode.FAILED_PRECONDITION, "blobs-missing",
                                       why))
            pinned[:] = refs_of(spec)
            record.set_phase(pb.JOB_PHASE_RUNNING)
            with self._host.idle.hold():     # another slice's gateway's job (multislice)
                yield from PeerCall(self._host, spec, payload, requests, record, context,
                                    paths, pinned, self._runs).events()
        finally:
            self._host.blobs.unpin(pinned)
            if payload_file and os.path.exists(payload_file):
                os.unlink(payload_file)
            with self._slot:
                self._count -= 1
                if not self._count:
                    self._job = ""
                self._slot.notify_all()
