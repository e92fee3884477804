"""The agent's gRPC service: health, and running jobs as gateway or peer."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator

import grpc

from remote_tpu._options import join_host_port
from remote_tpu._proto import remote_tpu_pb2 as pb
from remote_tpu._proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._limits import CHUNK_SIZE, DETAIL_CHARS, LIST_REPLY_BYTES, cut_text
from remote_tpu._serialization import check_compatible
from remote_tpu._topology import Topology
from remote_tpu._auth import TLS
from remote_tpu._transport import (ERROR_KIND_KEY, Credentials, channel_options, health,
                                   versions_pb)
from remote_tpu._version import PROTOCOL_VERSION, local_versions

from . import _worker
from ._discovery import MetadataServer, Slice, advertise_address
from ._events import EventQueue
from ._gateway import GatewayJob
from ._guard import TokenInterceptor
from ._runner import WorkerRun
from ._hostlog import DEFAULT_MAX_LOG_BYTES, StoreFull
from ._reports import bound_stacks
from ._scheduler import Scheduler
from ._slots import RESERVE_THREADS, Slots
from ._store import DEFAULT_MAX_STORE_BYTES, JobRecord, JobStore
from ._tpu import DEFAULT_DEVICES, DEFAULT_LOCKFILE, TpuBusy, TpuGuard
from ._worker_env import num_processes, passed_environment, worker_env

log = logging.getLogger(__name__)

PEER_STREAMS = 64          # one per process of this host in the jobs of its gateway

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")     # fullmatch only


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str = ""                 # address peers reach this host at
    slice: Slice = Slice()
    simulate_devices: int = 0           # > 0: JAX on CPU with this many devices
    state_dir: str = ""                 # job directories live here
    max_payload_bytes: int = 16 << 30
    token: str | None = dataclasses.field(default=None, repr=False)   # None: no auth
    tls_cert: str = ""                  # this agent's certificate and key (PEM files)
    tls_key: str = ""
    tls_ca: str = ""                    # CA of the slice's agents (and, with mtls, clients)
    mtls: bool = False                  # demand a client certificate signed by tls_ca
    pass_env: frozenset[str] = frozenset()   # more of the agent's variables for workers
    keep_jobs: int = 100                # finished jobs kept in the store
    tpu_lockfile: str = DEFAULT_LOCKFILE
    tpu_devices: tuple[str, ...] = DEFAULT_DEVICES
    kill_tpu_holders: bool = False
    peer_timeout: float = 10.0          # a silent peer is lost after this many seconds
    max_streams: int = 128              # long-lived calls served at once
    max_log_bytes: int = DEFAULT_MAX_LOG_BYTES       # per host and job: head and tail kept
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES   # every finished job's files together

    @property
    def peer_credentials(self) -> Credentials:
        """What this agent presents to its peers when it is the gateway."""
        tls = None
        if self.tls_ca:
            tls = TLS(ca=self.tls_ca, cert=self.tls_cert or None, key=self.tls_key or None)
        return Credentials(token=self.token, tls=tls, keepalive=self.peer_timeout)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, kind: str, message: str) -> None:
        super().__init__(message)
        self.code, self.kind, self.message = code, kind, message


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.address = advertise_address(config.host, config.advertise)   # host only
        self.port = config.port          # the bound port, once create_server has bound it
        self.state_dir = config.state_dir or tempfile.mkdtemp(prefix="remote-tpu-agent-")
        self.store = JobStore(self.state_dir, keep=config.keep_jobs,
                              max_log_bytes=config.max_log_bytes,
                              max_store_bytes=config.max_store_bytes)
        # Uploads in progress; what an earlier agent left there died with it.
        self._incoming = os.path.join(self.state_dir, "incoming")
        shutil.rmtree(self._incoming, ignore_errors=True)
        os.makedirs(self._incoming, mode=0o700, exist_ok=True)
        self.tpu = TpuGuard.for_agent(config.simulate_devices, config.tpu_lockfile,
                                      config.tpu_devices, config.kill_tpu_holders)
        self.scheduler = Scheduler(self._make_job)
        self.streams = Slots(config.max_streams, "long-lived calls (attached runs, log "
                             "followers, uploads, results)",
                             "close some followers (logs(follow=True), `jobs logs -f`) or "
                             "start the agent with a larger --max-streams")
        self.peer_streams = Slots(PEER_STREAMS, "calls from gateways",
                                  "a gateway is sending more processes than one host runs")
        # A host runs one job's workers at a time (several when processes_per_host > 1).
        self._peer_slot = threading.Condition()
        self._peer_job = ""
        self._peer_count = 0
        self._peer_runs: dict[tuple[str, int], WorkerRun] = {}
        self._worker_base_env = passed_environment(os.environ, config.pass_env)

    @property
    def endpoint(self) -> str:
        return join_host_port(self.address, self.port)

    # ------------------------------------------------------------ RPCs

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        found = self.config.slice
        return pb.HealthReply(versions=versions_pb(), agent_address=self.endpoint,
                              worker_id=found.worker_id, peers=found.peers,
                              simulate_devices=self.config.simulate_devices,
                              accelerator=found.accelerator, slice_source=found.source,
                              tpu_busy=self.tpu.busy())

    def Submit(self, request_iterator: Iterator[pb.RunRequest],
               context: grpc.ServicerContext) -> pb.JobStatus:
        release = self.streams.take(context, self.endpoint)
        try:
            spec = self._checked_spec(request_iterator, context, pb.ROLE_GATEWAY)
            record, created = self._accept(spec, request_iterator, context)
        finally:
            release()
        status = self._status(record)
        status.existed = not created
        return status

    def Run(self, request_iterator: Iterator[pb.RunRequest],
            context: grpc.ServicerContext) -> Iterator[pb.Event]:
        spec = self._checked_spec(request_iterator, context, None)
        if spec.role == pb.ROLE_PEER:
            yield from self._in_slot(self.peer_streams, context,
                                     self._run_peer(spec, request_iterator, context))
            return
        yield from self._in_slot(self.streams, context,
                                 self._run_attached(spec, request_iterator, context))

    def _in_slot(self, slots: Slots, context: grpc.ServicerContext,
                 events: Iterator[pb.Event]) -> Iterator[pb.Event]:
        """``events``, streamed while holding one of ``slots`` (refused without one)."""
        release = slots.take(context, self.endpoint)
        try:
            yield from events
        finally:
            release()

    def _run_attached(self, spec: pb.JobSpec, request_iterator: Iterator[pb.RunRequest],
                      context: grpc.ServicerContext) -> Iterator[pb.Event]:
        record, _ = self._accept(spec, request_iterator, context)

        def on_done() -> None:        # an attached job does not outlive its caller
            if not record.finished:
                self.scheduler.cancel(record.job_id, "the attached caller went away")
        context.add_callback(on_done)
        status = self._status(record)
        if status.phase == pb.JOB_PHASE_QUEUED and status.queued_behind:
            yield pb.Event(host=0, queued=status)
        hosts = {pb.STREAM_MODE_ALL: list(range(num_processes(record.spec))),
                 pb.STREAM_MODE_NONE: []}.get(spec.stream, [0])
        yield from self._watch(record, hosts, [], follow=True, context=context, with_end=False)
        yield from self._result(record)

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext
              ) -> Iterator[pb.Event]:
        record = self._known(request.job_id, context)
        hosts = list(request.hosts) or [0]
        count = max(1, num_processes(record.spec))
        bad = [h for h in hosts if h >= count]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"job {record.job_id} has processes 0-{count - 1}, not {bad[0]}")
        yield from self._in_slot(self.streams, context, self._watch(
            record, hosts, list(request.offsets), request.follow, context, with_end=True))

    def Result(self, request: pb.JobRef, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        record = self._known(request.job_id, context)
        if not record.finished:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {record.job_id} has not finished yet")
        yield from self._in_slot(self.streams, context, self._result(record))

    def Status(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        return self._status(self._known(request.job_id, context))

    def Cancel(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        record = self._known(request.job_id, context)
        if not record.finished:
            self.scheduler.cancel(record.job_id, "cancelled on request")
        return self._status(record)

    def Stacks(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.StacksReply:
        stacks = self.scheduler.stacks(request.job_id)
        if stacks is not None:
            return pb.StacksReply(hosts=bound_stacks(stacks))
        runs = [run for (job, _), run in list(self._peer_runs.items())
                if job == request.job_id]
        if runs:
            return pb.StacksReply(hosts=bound_stacks(
                [pb.HostStacks(host=run.host, text=run.stacks()) for run in runs]))
        record = self._known(request.job_id, context)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"job {record.job_id} is not running "
                      f"({pb.JobPhase.Name(record.status.phase)}): it has no stacks")

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext
                 ) -> pb.ListJobsReply:
        """Summaries (no final reports), newest first, as many as fit one reply."""
        reply = pb.ListJobsReply()
        statuses = self.store.list(limit=request.limit)
        size = 0
        for i, status in enumerate(statuses):
            summary = pb.JobStatus()
            summary.CopyFrom(status)
            summary.ClearField("end")
            size += summary.ByteSize() + 8
            if size > LIST_REPLY_BYTES:
                reply.omitted = len(statuses) - i
                break
            reply.jobs.append(summary)
        return reply

    def Doctor(self, request: pb.DoctorRequest, context: grpc.ServicerContext
               ) -> pb.DoctorReply:
        if request.hosts:
            peers, me = list(request.hosts), 0
        else:
            peers = list(self.config.slice.peers) or [self.endpoint]
            me = self.config.slice.worker_id

        def ask(i: int) -> pb.HostHealth:
            if i == me:
                return pb.HostHealth(host=i, address=peers[i],
                                     health=self.Health(pb.HealthRequest(), context))
            credentials = self.config.peer_credentials
            try:
                with credentials.channel(peers[i]) as channel:
                    reply = health(peers[i], channel, credentials, attempts=1)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return pb.HostHealth(host=i, address=peers[i], error=str(exc))
            return pb.HostHealth(host=i, address=peers[i], health=reply)

        with concurrent.futures.ThreadPoolExecutor(min(32, len(peers))) as pool:
            return pb.DoctorReply(hosts=list(pool.map(ask, range(len(peers)))))

    # ------------------------------------------------------------ jobs

    def _known(self, job_id: str, context: grpc.ServicerContext) -> JobRecord:
        record = self.store.get(job_id) if _JOB_ID.fullmatch(job_id) else None
        if record is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"the agent at {self.endpoint} has no job {cut_text(job_id, 200)!r} "
                          f"(finished jobs are kept: the newest {self.config.keep_jobs})")
        return record

    @staticmethod
    def _status(record: JobRecord) -> pb.JobStatus:
        with record.changed:
            status = pb.JobStatus()
            status.CopyFrom(record.status)
        return status

    def _accept(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
                context: grpc.ServicerContext) -> tuple[JobRecord, bool]:
        """Queue a new job, or find the one with this id (idempotent submission)."""
        existing = self.store.get(spec.job_id)
        if existing is not None:
            return existing, False
        try:
            hosts = self._hosts_for(spec)
        except _Refused as r:
            self._abort(context, r)
        fd, path = tempfile.mkstemp(dir=self._incoming, prefix=spec.job_id)
        os.close(fd)
        try:
            self._receive_payload(spec, requests, path, context)
            spec.num_hosts = len(hosts)
            spec.hosts[:] = hosts
            record, created = self.store.create(spec, pb.ROLE_GATEWAY)
            if created:
                os.replace(path, os.path.join(record.dir, _worker.PAYLOAD_FILE))
                self.scheduler.submit(record)
                log.info("job %s: queued (%d host(s))", spec.job_id, len(hosts))
            return record, created
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _make_job(self, record: JobRecord) -> GatewayJob:
        spec = record.spec
        return GatewayJob(spec=spec, hosts=list(spec.hosts), job_dir=record.dir,
                          payload_path=os.path.join(record.dir, _worker.PAYLOAD_FILE),
                          advertise=self.address, peer_credentials=self.config.peer_credentials,
                          tpu=self.tpu, preempted=self.preempted,
                          env_for=lambda i, coord: self._env_for(spec, i, coord))

    def _watch(self, record: JobRecord, hosts: list[int], offsets: list[int], follow: bool,
               context: grpc.ServicerContext, with_end: bool) -> Iterator[pb.Event]:
        """Every host's output from its offset to the end of its log: without
        ``follow`` the end as it is now, with it the job's end (every byte
        written before the job finished is sent before the end)."""
        position = {h: (offsets[i] if i < len(offsets) else 0) for i, h in enumerate(hosts)}
        # Without follow, a running job's logs are read up to where they end now.
        stop = None if follow or record.finished else {h: record.log(h).end() for h in hosts}
        while context.is_active():
            with record.changed:
                finished = record.finished
                version = record.version
            sent = False
            for h in hosts:
                if stop is not None and position[h] >= stop[h]:
                    continue
                for stream, data, offset in record.log(h).read(position[h]):
                    position[h] = offset
                    sent = True
                    yield pb.Event(host=h, output=pb.Output(stream=stream, data=data,
                                                            offset=offset))
            if sent:
                continue              # read on until a pass finds nothing new
            if finished:
                if with_end:
                    yield pb.Event(host=0, end=self._status(record).end)
                return
            if not follow:
                return
            with record.changed:
                record.changed.wait_for(lambda: record.version != version, timeout=1.0)

    def _result(self, record: JobRecord) -> Iterator[pb.Event]:
        if record.status.phase == pb.JOB_PHASE_SUCCEEDED:
            with open(os.path.join(record.dir, _worker.RESULT_FILE), "rb") as f:
                while chunk := f.read(CHUNK_SIZE):
                    yield pb.Event(host=0, result_chunk=chunk)
        yield pb.Event(host=0, end=record.status.end)

    # ------------------------------------------------------------ checks

    @staticmethod
    def _abort(context: grpc.ServicerContext, refused: _Refused) -> None:
        context.set_trailing_metadata(((ERROR_KIND_KEY, refused.kind),))
        # Status details travel as metadata: gRPC refuses more than 16 KiB of it.
        context.abort(refused.code, cut_text(refused.message, DETAIL_CHARS))

    def _checked_spec(self, requests: Iterator[pb.RunRequest], context: grpc.ServicerContext,
                      role: int | None) -> pb.JobSpec:
        try:
            spec = self._read_spec(requests)
            if role is not None and spec.role != role:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                               "Submit takes gateway jobs only")
            return spec
        except _Refused as r:
            self._abort(context, r)
            raise AssertionError("unreachable")

    def _read_spec(self, requests: Iterator[pb.RunRequest]) -> pb.JobSpec:
        first = next(requests, None)
        if first is None or not first.HasField("spec"):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                           "a Run call must start with a JobSpec")
        spec = first.spec
        client = spec.client_versions
        if client.protocol != PROTOCOL_VERSION:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, "version",
                f"protocol mismatch: the client speaks remote_tpu protocol {client.protocol} "
                f"(remote_tpu {client.remote_tpu or '?'}), this agent at {self.endpoint} "
                f"speaks protocol {PROTOCOL_VERSION} (remote_tpu "
                f"{local_versions()['remote_tpu']}). Install the same remote_tpu version "
                "on the client and on every host.")
        try:
            check_compatible({"python": client.python, "cloudpickle": client.cloudpickle},
                             sender=f"the client of the agent at {self.endpoint}")
        except Exception as exc:  # noqa: BLE001
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "version", str(exc)) from None
        if not _JOB_ID.fullmatch(spec.job_id):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                           f"job id {cut_text(spec.job_id, 200)!r} is not valid: use 1-64 "
                           "letters, digits, "
                           "'.', '_' or '-', starting with a letter or digit")
        if spec.payload_size > self.config.max_payload_bytes:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "config",
                           f"payload of {spec.payload_size} bytes is over this agent's limit "
                           f"of {self.config.max_payload_bytes} bytes")
        if spec.role not in (pb.ROLE_GATEWAY, pb.ROLE_PEER):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                           f"unknown role {spec.role}")
        if spec.stream not in (pb.STREAM_MODE_LEADER, pb.STREAM_MODE_ALL, pb.STREAM_MODE_NONE):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                           f"unknown stream mode {spec.stream}")
        if len(spec.payload_sha256) != hashlib.sha256().digest_size:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                           "the job spec carries no SHA-256 digest of its payload")
        if spec.role == pb.ROLE_PEER and not (
                0 < spec.process_id < num_processes(spec) and spec.coordinator_address):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                           f"peer job needs 0 < process_id < num_hosts and a coordinator; "
                           f"got process {spec.process_id} of {spec.num_hosts}, coordinator "
                           f"{spec.coordinator_address!r}")
        return spec

    def _hosts_for(self, spec: pb.JobSpec) -> list[str]:
        try:
            topology = Topology.parse(spec.accelerator)
        except ValueError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "config", str(exc)) from None
        found = self.config.slice
        peers = found.peers
        if not spec.hosts and peers and found.worker_id != 0:
            # Any host can answer: the client follows this to worker 0.
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, f"redirect {peers[0]}",
                f"the agent at {self.endpoint} is worker {found.worker_id} of its slice; "
                f"the gateway is worker 0 at {peers[0]}")
        if found.accelerator and not spec.hosts:
            mine = Topology.parse(found.accelerator)
            if mine.name != topology.name:
                raise _Refused(
                    grpc.StatusCode.FAILED_PRECONDITION, "config",
                    f"asked for {topology.name}, {topology.hosts} host(s); this slice is "
                    f"{mine.name.removeprefix('tpu-')}, {mine.hosts} host(s) (from its "
                    f"{found.source}). Use accelerator={mine.name!r}.")
        hosts = list(spec.hosts) or list(peers) or [self.endpoint]
        if len(hosts) != topology.hosts:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "config",
                f"{topology.name} has {topology.hosts} host(s), but the slice behind the "
                f"agent at {self.endpoint} has {len(hosts)}: {', '.join(hosts)}. Use the "
                "accelerator this slice really is, or pass every host in hosts=[...].")
        return hosts

    def _receive_payload(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
                         path: str, context: grpc.ServicerContext) -> None:
        try:
            self._store_payload(spec, requests, path, context)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._abort(context, _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                f"the agent at {self.endpoint} cannot store job {spec.job_id}'s payload "
                f"({spec.payload_size:,} bytes): {self.store.full_message()}. Nothing was run."))

    def _store_payload(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
                       path: str, context: grpc.ServicerContext) -> None:
        received = 0
        digest = hashlib.sha256()
        with open(path, "wb", opener=_worker.private) as f:
            while received < spec.payload_size:
                req = next(requests, None)
                if req is None or not req.HasField("payload_chunk"):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"payload truncated: got {received} of {spec.payload_size} "
                                  "bytes")
                received += len(req.payload_chunk)
                if received > spec.payload_size:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"payload longer than the announced {spec.payload_size} "
                                  "bytes")
                f.write(req.payload_chunk)
                digest.update(req.payload_chunk)
        if digest.digest() != spec.payload_sha256:
            context.set_trailing_metadata(((ERROR_KIND_KEY, "integrity"),))
            context.abort(grpc.StatusCode.DATA_LOSS,
                          f"the payload received by the agent at {self.endpoint} does not "
                          "match its SHA-256 digest: it was corrupted or altered on the "
                          "way. Nothing was run.")

    def _env_for(self, spec: pb.JobSpec, process_id: int, coordinator: str) -> dict[str, str]:
        return worker_env(self._worker_base_env, spec=spec, process_id=process_id,
                          coordinator=coordinator,
                          simulate_devices=self.config.simulate_devices)

    def _run_peer(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
                  context: grpc.ServicerContext) -> Iterator[pb.Event]:
        """This host's part of a gateway's job: one worker, obeying the gateway."""
        with self._peer_slot:
            free = self._peer_slot.wait_for(
                lambda: self._peer_count == 0 or self._peer_job == spec.job_id, timeout=5)
            if not free:
                self._abort(context, _Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                    f"host {self.endpoint} is still running job {self._peer_job}'s worker"))
            self._peer_job = spec.job_id
            self._peer_count += 1
        mine = pb.JobSpec()
        mine.CopyFrom(spec)
        mine.job_id = f"{spec.job_id}.p{spec.process_id}"     # this process's own record
        try:
            record, created = self.store.create(mine, pb.ROLE_PEER)
            if not created:
                self._abort(context, _Refused(grpc.StatusCode.ALREADY_EXISTS, "protocol",
                                              f"job {spec.job_id} already ran on this host"))
            self._receive_payload(spec, requests, os.path.join(record.dir, _worker.PAYLOAD_FILE),
                                  context)
            try:
                self.tpu.prepare()
            except TpuBusy as exc:
                record.set_phase(pb.JOB_PHASE_FAILED, str(exc))
                self._abort(context, _Refused(grpc.StatusCode.FAILED_PRECONDITION, "busy",
                                              f"host {self.endpoint}: {exc}"))
            record.set_phase(pb.JOB_PHASE_RUNNING)
            yield from self._peer_events(spec, requests, record, context)
        finally:
            try:
                os.unlink(os.path.join(self.store.get(mine.job_id, pb.ROLE_PEER).dir,
                                       _worker.PAYLOAD_FILE))
            except (OSError, AttributeError):
                pass
            with self._peer_slot:
                self._peer_count -= 1
                if not self._peer_count:
                    self._peer_job = ""
                self._peer_slot.notify_all()

    def _peer_events(self, spec, requests, record: JobRecord, context) -> Iterator[pb.Event]:
        events = EventQueue()
        run = WorkerRun(host=spec.process_id, job_dir=record.dir,
                        env=self._env_for(spec, spec.process_id, spec.coordinator_address),
                        emit=events.put, forward_output=True)

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
        self._peer_runs[(spec.job_id, spec.process_id)] = run
        final = pb.JOB_PHASE_LOST
        try:
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
                    event.exited.preempted = self.preempted()
                yield event
                if event.HasField("exited"):
                    final = _PEER_PHASE.get(event.exited.state, pb.JOB_PHASE_FAILED)
                    if event.exited.preempted:
                        final = pb.JOB_PHASE_PREEMPTED
                    return
        finally:
            events.close()
            run.close()
            run.finished.wait(5)
            self._peer_runs.pop((spec.job_id, spec.process_id), None)
            self.tpu.release()
            record.set_phase(final, "" if final != pb.JOB_PHASE_LOST else
                             "the gateway went away before this host finished")

    def preempted(self) -> bool:
        """Whether this TPU VM has been preempted (asked only on a TPU VM)."""
        return self.config.slice.source == "metadata" and MetadataServer().preempted()

    def stop_all(self) -> None:
        """Agent shutdown: cancel every job (telling callers why) and kill every worker."""
        if self.preempted():
            self.scheduler.shutdown(f"host {self.endpoint} was preempted",
                                    pb.JOB_STATE_PREEMPTED)
        else:
            self.scheduler.shutdown(f"the gateway agent at {self.endpoint} is shutting down")
        for run in list(self._peer_runs.values()):
            run.close()
        self.store.close()


_PEER_PHASE = {
    pb.HOST_STATE_SUCCEEDED: pb.JOB_PHASE_SUCCEEDED,
    pb.HOST_STATE_FAILED: pb.JOB_PHASE_FAILED,
    pb.HOST_STATE_DIED: pb.JOB_PHASE_FAILED,
    pb.HOST_STATE_CANCELLED: pb.JOB_PHASE_CANCELLED,
}


def _server_credentials(config: AgentConfig) -> grpc.ServerCredentials:
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_server_credentials(
        [(read(config.tls_key), read(config.tls_cert))],
        root_certificates=read(config.tls_ca) if config.mtls else None,
        require_client_auth=config.mtls)


def create_server(config: AgentConfig) -> tuple[grpc.Server, int, AgentService]:
    """Build (not start) the agent's server; port 0 binds an ephemeral port."""
    options = channel_options({
        "grpc.max_concurrent_streams": config.max_streams + PEER_STREAMS + RESERVE_THREADS,
        # Notice a vanished caller within ~2.5 s: its attached job is then cancelled.
        "grpc.keepalive_time_ms": 1000,
        "grpc.keepalive_timeout_ms": 1500,
        "grpc.http2.min_recv_ping_interval_without_data_ms": 400,
        "grpc.http2.min_sent_ping_interval_without_data_ms": 1000,
        "grpc.http2.max_ping_strikes": 0,
    })
    interceptors = [TokenInterceptor(config.token)] if config.token else []
    # Every stream slot has its thread, and short calls keep a reserve of their own.
    threads = config.max_streams + PEER_STREAMS + RESERVE_THREADS
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="rpc"),
                         options=options, interceptors=interceptors,
                         maximum_concurrent_rpcs=threads + 64)
    service = AgentService(config)
    pb_grpc.add_AgentServicer_to_server(service, server)
    address = join_host_port(config.host, config.port)
    if config.tls_cert:
        port = server.add_secure_port(address, _server_credentials(config))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    service.port = port
    return server, port, service
