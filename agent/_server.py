"""The agent's gRPC service: health, and running jobs as gateway or peer."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator

import grpc

from remote_tpu._options import join_host_port
from remote_tpu._proto import remote_tpu_pb2 as pb
from remote_tpu._proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._serialization import check_compatible
from remote_tpu._topology import Topology
from remote_tpu._auth import TLS
from remote_tpu._transport import ERROR_KIND_KEY, Credentials, channel_options, versions_pb
from remote_tpu._version import PROTOCOL_VERSION, local_versions

from . import _worker
from ._discovery import Slice, advertise_address
from ._gateway import GatewayJob
from ._guard import TokenInterceptor
from ._runner import WorkerRun, passed_environment, worker_env

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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

    @property
    def peer_credentials(self) -> Credentials:
        """What this agent presents to its peers when it is the gateway."""
        tls = None
        if self.tls_ca:
            tls = TLS(ca=self.tls_ca, cert=self.tls_cert or None, key=self.tls_key or None)
        return Credentials(token=self.token, tls=tls)


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
        self._busy = threading.Lock()
        self._current = ""
        self._runs: set[WorkerRun] = set()
        self._jobs: set[GatewayJob] = set()
        self._worker_base_env = passed_environment(os.environ, config.pass_env)

    @property
    def endpoint(self) -> str:
        return join_host_port(self.address, self.port)

    # -------------------------------------------------------------- RPCs

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        return pb.HealthReply(versions=versions_pb(), agent_address=self.endpoint,
                              worker_id=self.config.slice.worker_id,
                              peers=self.config.slice.peers,
                              simulate_devices=self.config.simulate_devices)

    def Run(self, request_iterator: Iterator[pb.RunRequest],
            context: grpc.ServicerContext) -> Iterator[pb.Event]:
        try:
            spec = self._read_spec(request_iterator)
            hosts = self._hosts_for(spec) if spec.role == pb.ROLE_GATEWAY else []
        except _Refused as r:
            context.set_trailing_metadata(((ERROR_KIND_KEY, r.kind),))
            context.abort(r.code, r.message)
        if not self._busy.acquire(blocking=False):
            context.set_trailing_metadata(((ERROR_KIND_KEY, "busy"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"host {self.endpoint} is running job {self._current}; one job at a "
                          "time per slice. Wait for it to finish and call again.")
        self._current = spec.job_id
        job_dir = os.path.join(self.state_dir, "jobs", f"{spec.job_id}-{spec.process_id}")
        try:
            os.makedirs(job_dir)
            payload_path = os.path.join(job_dir, _worker.PAYLOAD_FILE)
            self._receive_payload(spec, request_iterator, payload_path, context)
            client_gone = threading.Event()
            if spec.role == pb.ROLE_GATEWAY:
                yield from self._run_gateway(spec, hosts, job_dir, payload_path, context,
                                             client_gone)
            else:
                yield from self._run_peer(spec, request_iterator, job_dir, context)
        finally:
            self._current = ""
            shutil.rmtree(job_dir, ignore_errors=True)
            self._busy.release()

    # -------------------------------------------------------------- helpers

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
        if not _JOB_ID.match(spec.job_id):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                           f"job id {spec.job_id!r} is not valid: use 1-64 letters, digits, "
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
                0 < spec.process_id < spec.num_hosts and spec.coordinator_address):
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
        peers = self.config.slice.peers
        if not spec.hosts and peers and self.config.slice.worker_id != 0:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, "config",
                f"the agent at {self.endpoint} is worker {self.config.slice.worker_id} of its "
                f"slice; the gateway must be worker 0: point hosts= at {peers[0]}")
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
        received = 0
        digest = hashlib.sha256()
        with open(path, "wb") as f:
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
        return worker_env(self._worker_base_env, job_id=spec.job_id,
                          accelerator=spec.accelerator,
                          process_id=process_id, num_processes=spec.num_hosts,
                          coordinator=coordinator,
                          simulate_devices=self.config.simulate_devices,
                          timeouts=spec.jax_timeouts, user_env=dict(spec.env),
                          payload_sha256=spec.payload_sha256)

    def _run_gateway(self, spec, hosts, job_dir, payload_path, context, client_gone):
        spec.num_hosts = len(hosts)
        job = GatewayJob(spec=spec, hosts=hosts, job_dir=job_dir, payload_path=payload_path,
                         advertise=self.address, peer_credentials=self.config.peer_credentials,
                         env_for=lambda i, coord: self._env_for(spec, i, coord))

        def on_done() -> None:
            if context.is_active():
                return
            client_gone.set()
            job.events.put(None)
        context.add_callback(on_done)
        log.info("job %s: gateway for %d host(s), coordinator %s", spec.job_id, len(hosts),
                 job.coordinator)
        self._jobs.add(job)
        try:
            yield from job.run(client_gone)
        finally:
            self._jobs.discard(job)

    def _run_peer(self, spec, requests, job_dir, context):
        events: queue.Queue = queue.Queue()
        run = WorkerRun(host=spec.process_id, job_dir=job_dir,
                        env=self._env_for(spec, spec.process_id, spec.coordinator_address),
                        emit=events.put, forward_output=spec.stream == pb.STREAM_MODE_ALL)

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
        self._runs.add(run)
        try:
            run.start()
            threading.Thread(target=obey, daemon=True, name="peer-control").start()
            while True:
                event = events.get()
                if event is None:
                    return
                yield event
                if event.HasField("exited"):
                    return
        finally:
            run.close()
            self._runs.discard(run)

    def stop_all(self) -> None:
        """Agent shutdown: cancel every job (telling callers why) and kill every worker."""
        for job in list(self._jobs):
            job.shutdown(f"the gateway agent at {self.endpoint} is shutting down")
        for run in list(self._runs):
            run.close()


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
    options = channel_options() + [("grpc.max_concurrent_streams", 64)]
    interceptors = [TokenInterceptor(config.token)] if config.token else []
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                               thread_name_prefix="rpc"),
                         options=options, interceptors=interceptors,
                         maximum_concurrent_rpcs=128)
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
