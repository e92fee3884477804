"""One call to a slice: attached (output live, the value returned) or
submitted (a handle returned at once). Where it goes is ``_target``'s."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from . import _blobs as blobs
from . import _call_lane as call_lane
from . import _transport, _trees
from ._core import data_wire
from ._core.channels import BlobsMissing
from ._core.proto import remote_tpu_pb2 as pb
from ._core.serialization import Payload
from ._core.versions import versions_pb
from ._interrupts import FirstCtrlC, raise_interrupted
from ._jobs import JobHandle
from ._option_checks import job_stem
from ._options import RunOptions, spec_fields
from ._outcome import outcome, result_request
from ._render import OutputRenderer
from ._status import LiveStatus
from ._core.limits import upload_deadline
from ._target import Target, resolve_target
from ._transport import requests as _requests

_client_id = ("", 0)


def client_id() -> str:
    """This process, as its gateway tells callers apart: its calls share warm
    workers (a forked child is another caller)."""
    global _client_id
    if _client_id[1] != os.getpid():
        _client_id = (f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
                      os.getpid())
    return _client_id[0]


def new_job_id(name: str) -> str:
    return f"{job_stem(name)}-{uuid.uuid4().hex[:12]}"


def _with_blobs(target: Target, payload: Payload, trees: _trees.Trees,
                status: LiveStatus | None = None) -> tuple[Payload, list[pb.BlobRef]]:
    """``payload`` and its large buffers' references, once the gateway holds
    them (``_blobs``); or the payload with its buffers inside, where it cannot
    (beside the call's ``trees``, which must stay there too)."""
    if not payload.blobs:
        return payload, []
    started = time.monotonic()
    refs = blobs.send(target, payload, None if status is None else (
        lambda sent, total: status.uploading(sent, total, started)), beside=trees.nbytes())
    if refs is None:
        return payload.inline(), []
    return payload, refs


def _target(options: RunOptions) -> Target:
    if options.slices:
        from ._slices import resolve
        return resolve(options.slices, options.topology, options.token, options.tls)
    if options.num_slices > 1:           # hosts="local": N simulated slices
        from ._local_slice import get_local_slice
        local = get_local_slice(options.topology, options.num_slices)
        return Target(local.addresses[0], local.addresses, local.credentials, local=True)
    return resolve_target(options.hosts, topology=options.topology, token=options.token,
                          tls=options.tls)


def _spec(options: RunOptions, payload: Payload, job_id: str, target: Target,
          trees: _trees.Trees, attempt: int = 0, earlier: list | None = None,
          submitted: bool = False) -> pb.JobSpec:
    """The job's spec, once the gateway holds its ``trees`` (working_dir=,
    local Data); with retries=, REMOTE_TPU_ATTEMPT says which attempt it is."""
    tree, data = _trees.send(target, trees)
    spec = pb.JobSpec(
        **spec_fields(options),           # what the options fill themselves (_options)
        client_versions=versions_pb(), job_id=job_id, role=pb.ROLE_GATEWAY,
        hosts=target.hosts, payload_size=payload.nbytes, payload_digest=payload.digest(),
        client_id=client_id(), working_dir=tree, data=data, gcs_data=trees.gcs,
        keep_going=options.keep_going,
        result_over_data_port=data_wire.worth_trying(target.gateway, target.credentials),
        value_in_end=True,
        offer_lane=bool(options.keep_warm) and not submitted and
        data_wire.worth_trying(target.gateway, target.credentials),
    )
    retries = options.retries
    if retries is not None and submitted:       # its gateway tries it again (_attempts)
        spec.retries.CopyFrom(pb.RetryPolicy(
            preemptions=retries.preemptions, failures=retries.failures,
            backoff_seconds=retries.backoff, backoff_max_seconds=retries.backoff_max))
    elif retries is not None:                   # this process does (_retries)
        spec.env["REMOTE_TPU_ATTEMPT"] = str(attempt)
        spec.earlier_attempts.extend(earlier or [])
    return spec


def call(options: RunOptions, payload: Payload, job_id: str, attempt: int = 0,
         earlier: list | None = None,
         started: Callable[[str, Target], None] | None = None) -> Any:
    """Run attached: output shown live, the value returned; the job is cancelled
    on every host if this call is interrupted or this process goes away.
    ``started(job_id, target)``: told each job id before it is sent."""
    target = _target(options)
    if started is not None:
        started(job_id, target)
    status = LiveStatus(processes=options.topology.hosts * options.num_slices *
                        options.processes_per_host, jax=options.init_jax)
    sending = _Sending(status)
    ask = None if not options.keep_warm else (lambda: target.stub().Cancel(
        pb.JobRef(job_id=sending.job_id, interrupt=True), timeout=3,
        metadata=target.credentials.metadata))
    with FirstCtrlC(lambda: sending.job_id, ask, ready=lambda: bool(sending.sent)) \
            as first_ctrl_c:
        try:
            trees = _trees.prepare(target, options.working_dir, payload)
            payload, refs = _with_blobs(target, payload, trees, status)
            spec = _spec(options, payload, job_id, target, trees, attempt, earlier)
            spec.blobs.extend(refs)
            if options.keep_warm and not target.local:
                _release_at_exit(target)
            status.phase("remote_tpu: waiting for the slice")
            sending.spec, sending.payload = spec, payload
            try:
                stream = target.call(sending.start, retry=True)
            except BlobsMissing:     # evicted since they were sent: they go inside this time
                payload = payload.inline()
                spec = _spec(options, payload, new_job_id(job_id.rpartition("-")[0]), target,
                             trees, attempt, earlier)
                job_id = spec.job_id
                if started is not None:
                    started(job_id, target)
                sending.spec, sending.payload = spec, payload
                stream = target.call(lambda t: sending.start(t, lane=False), retry=True)
        except BaseException as exc:
            status.close()           # refused or unreachable: the line goes with the call
            if isinstance(exc, KeyboardInterrupt) and sending.sent:
                _say_cancelled(options, job_id, surely=sending.sent == "surely")   # (a warm
            raise                                           # call's first event can be its end)
        label = "process" if options.processes_per_host > 1 else "host"
        renderer = OutputRenderer(options.stream, label, per_slice=(
            options.topology.hosts * options.processes_per_host if options.num_slices > 1 else 0))
        interrupted = False
        stream = _LaneOffers(stream)
        error: Exception | None = None
        try:
            with first_ctrl_c:
                try:
                    value = outcome(stream, renderer, gateway=target.gateway, job_id=job_id,
                                    accelerator=options.topology.name, status=status,
                                    refetch=lambda: target.stub().Result(
                                        result_request(job_id),
                                        metadata=target.credentials.metadata))
                except Exception as exc:
                    if not first_ctrl_c.asked:
                        raise
                    error = exc
        except KeyboardInterrupt:         # (a warm call's second Ctrl-C)
            interrupted = True
            _say_cancelled(options, job_id)
            raise
        finally:
            if stream.lane is not None:
                call_lane.opened(target.gateway, target.credentials, stream.lane)
            if options.output_dir and not interrupted:      # the job's files, failed or not
                _say_where_outputs_are(target, job_id, options.output_dir, spec.collect_outputs)
            if options.profile and not interrupted:
                where = f"{options.output_dir}/{job_id}"
                print(f"remote_tpu: every host's jax.profiler trace of job {job_id} is under "
                      f"{where}/host_*/plugins/profile/ (view them: tensorboard --logdir {where}, "
                      "or XProf)", file=sys.stderr, flush=True)
        if first_ctrl_c.asked:
            raise_interrupted(job_id, stream.end, error)
        return value


def _say_where_outputs_are(target: Target, job_id: str, output_dir: str,
                           collect_here: bool) -> None:
    """One line at the end of a call with ``output_dir=``: where its files
    are (a local one: brought here first, and how many)."""
    where = f"{output_dir.rstrip('/')}/{job_id}/"
    if collect_here:
        from ._output_files import collect
        files = collect(target, job_id, output_dir)
        said = (f"{len(files)} file{'s' if len(files) != 1 else ''} under {where}" if files
                else f"none: no host wrote any (they would be under {where})")
    else:
        said = f"under {where} (each host's, uploaded by its agent)"
    print(f"remote_tpu: job {job_id}'s output files: {said}", file=sys.stderr, flush=True)


def _say_cancelled(options: RunOptions, job_id: str, surely: bool = True) -> None:
    if options.keep_warm and surely:
        print(f"remote_tpu: job {job_id} was cancelled on every host; the warm workers "
              "were stopped with it (remote_tpu.state is gone: the next call starts "
              "fresh)", file=sys.stderr, flush=True)
    elif options.keep_warm:
        print(f"remote_tpu: job {job_id} was interrupted before the slice answered: if it "
              "had reached it, it was cancelled on every host and the warm workers were "
              "stopped with it (remote_tpu.state is then gone: the next call starts fresh)",
              file=sys.stderr, flush=True)


_warm_targets: dict[tuple[str, Any], Target] = {}


def _release_at_exit(target: Target) -> None:
    """Warm workers of this process on a slice it does not own (its caller id
    dies with it) would only hold the slice for others: end them at exit."""
    key = (target.gateway, target.credentials)
    if not _warm_targets:
        atexit.register(_release_all)
    _warm_targets.setdefault(key, target)


def _release_all() -> None:
    for target in _warm_targets.values():
        try:
            target.stub().Release(pb.ReleaseRequest(client_id=client_id()), timeout=5,
                                  metadata=target.credentials.metadata)
        except grpc.RpcError:
            pass                    # its idle time ends them all the same


class _Sending:
    """An attached call on its way to the gateway, up to its first event: on
    the first way (``_transport``) that takes it; ``start`` is one attempt
    (``Target.call`` may make several). ``sent``: whether Ctrl-C cancels the
    call on the slice: "surely" once it went on the lane, "maybe" while gRPC
    waits for its first event, "" while it is not there."""

    def __init__(self, status: LiveStatus) -> None:
        self._status = status
        self.spec: pb.JobSpec | None = None
        self.payload: Payload | None = None
        self.sent = ""

    @property
    def job_id(self) -> str:
        return self.spec.job_id if self.spec is not None else ""

    def start(self, target: Target, lane: bool = True) -> Any:
        try:
            return _transport.start(target, self.spec, self.payload, self._status,
                                    self._trying, _transport.TRANSPORTS[0 if lane else 1:])
        except Exception:
            self.sent = ""              # (not there: tried again, or given up)
            raise

    def _trying(self, transport: _transport.Transport) -> Callable[[], None]:
        self.sent = "maybe"
        return self._surely

    def _surely(self) -> None:
        self.sent = "surely"


class _LaneOffers:
    """A call's events as they come; ``lane``: the ticket its end carried."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.lane: pb.DataTicket | None = None
        self.end: pb.JobEnd | None = None

    def __iter__(self) -> Iterator[pb.Event]:
        for event in self._stream:
            if event.HasField("end"):
                self.end = event.end
                if event.end.HasField("lane"):
                    self.lane = event.end.lane
            yield event

    def cancel(self) -> None:
        self._stream.cancel()


def submit(options: RunOptions, payload: Payload, job_id: str) -> JobHandle:
    """Queue the job and return its handle at once; retried on transient faults
    only, which cannot start it twice (the agent knows the job id)."""
    target = _target(options)
    trees = _trees.prepare(target, options.working_dir, payload)
    payload, refs = _with_blobs(target, payload, trees)
    spec = _spec(options, payload, job_id, target, trees, submitted=True)
    spec.blobs.extend(refs)

    def send() -> None:
        target.call(lambda t: t.stub().Submit(_requests(spec, payload),
                                              metadata=t.credentials.metadata,
                                              timeout=upload_deadline(payload.nbytes)),
                    retry=True)
    try:
        send()
    except BlobsMissing:         # evicted since they were sent: they go inside this time
        payload = payload.inline()
        spec = _spec(options, payload, new_job_id(job_id.rpartition("-")[0]), target,
                     trees, submitted=True)
        job_id = spec.job_id
        send()
    return JobHandle(job_id, target, accelerator=options.topology.name,
                     output_dir=options.output_dir)
