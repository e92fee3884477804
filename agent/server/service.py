"""The agent's gRPC service: a thin servicer that maps each RPC to the object
that does the work, and ``create_server`` that builds it.

- Health, Doctor: ``SliceQueries`` (``server.slice_queries``);
- Run and Submit as the gateway: ``GatewayRole`` (``gateway.role``), which queues
  jobs with the ``Scheduler`` and runs each as a ``GatewayJob``;
- Run as a peer (from a gateway): ``PeerRole`` (``peer.role``);
- Watch, Result, Status, ListJobs: ``JobViews`` (``jobs.views``) over the store;
- Cancel, Stacks: the scheduler, or the peer role's workers;
- Release: the scheduler's warm session.

Requests are checked in ``jobs.requests``; payloads are received by ``host.uploads``;
long-lived calls take a slot first (``server.slots``), so short calls always answer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

import grpc

from remote_tpu._core.addresses import host_of, join_host_port
from remote_tpu._core.multislice import disagreement
from remote_tpu._core.channels import channel_options
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._core.states import phase_name

from remote_tpu_agent.peer import role as _peer
from remote_tpu_agent.host.config import AgentConfig
from remote_tpu_agent.wire.discovery import MetadataServer, advertise_address
from remote_tpu_agent.gateway.role import GatewayRole
from remote_tpu_agent.server.guard import Refusals, TokenInterceptor
from remote_tpu_agent.host.shared import Host
from remote_tpu_agent.jobs.views import JobViews, result, status_of, watch
from remote_tpu_agent.host.output_dir import output_env, own_files, slice_files
from remote_tpu_agent.peer.role import PeerRole
from remote_tpu_agent.wire.peer_link_server import offer_link
from remote_tpu_agent.host.blobs import BlobCache, check_ref
from remote_tpu_agent.wire import caller_lane as call_lane
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu_agent.host.cache_dir import cache_dir
from remote_tpu_agent.gateway.reports import bound_stacks
from remote_tpu_agent.jobs.requests import Refused, abort, checked_spec, gateway_redirect, valid_job_id
from remote_tpu_agent.server.slice_queries import SliceQueries
from remote_tpu_agent.server.slots import RESERVE_THREADS, Slots
from remote_tpu_agent.jobs.store import JobStore
from remote_tpu_agent.host.tpu import TpuGuard
from remote_tpu_agent.host.uploads import Uploads
from remote_tpu_agent.gateway.warm import is_session
from remote_tpu_agent.host.envs import Envs
from remote_tpu_agent.host.pythons import Pythons
from remote_tpu_agent.host.working_dirs import WorkingDirs
from remote_tpu_agent.worker.spares import Spares
from remote_tpu_agent.worker.environment import (child_environment, num_processes, num_slices, spare_env,
                          worker_env)

log = logging.getLogger(__name__)


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.refusals = Refusals()       # calls refused for their token, by peer
        self.address = advertise_address(config.host, config.advertise)   # host only
        self.port = config.port          # the bound port, once create_server has bound it
        # No state dir given: an ephemeral agent's, removed when it stops.
        self._own_state_dir = not config.state_dir
        self.state_dir = config.state_dir or tempfile.mkdtemp(prefix="remote-tpu-agent-")
        self.store = JobStore(self.state_dir, keep=config.keep_jobs,
                              max_log_bytes=config.max_log_bytes,
                              max_store_bytes=config.max_store_bytes)
        uploads = Uploads(self.state_dir, lambda: self.endpoint, self.store.full_message)
        self.tpu = TpuGuard.for_agent(config.simulate_devices, config.tpu_lockfile,
                                      config.tpu_devices, config.kill_tpu_holders)
        self._worker_base_env = child_environment(os.environ, config.pass_env)
        self.spares = Spares(spare_env(self._worker_base_env, config.simulate_devices),
                             self.state_dir, config.spare_workers, config.light_spares)
        self.blobs = BlobCache(cache_dir(config.cache_dir, self.state_dir),
                               config.cache_bytes)
        self.data_port: DataPort | None = None     # opened once the gRPC port is bound
        host = Host(store=self.store, uploads=uploads, blobs=self.blobs, tpu=self.tpu,
                    spares=self.spares,
                    endpoint=lambda: self.endpoint, env_for=self._env_for,
                    preempted=self.preempted,
                    workdirs=WorkingDirs(os.path.join(self.state_dir, "workdirs")),
                    envs=Envs(os.path.join(self.state_dir, "envs"), Pythons(
                        os.path.join(self.state_dir, "pythons"), config.pythons,
                        config.python_downloads, child_environment(
                            os.environ, config.pass_env, installer=True))),
                    output_interval=config.output_interval,
                    simulated=bool(config.simulate_devices),
                    data_port=lambda: self.data_port)
        self.gateway = GatewayRole(config=config, host=host, advertise=self.address)
        self.scheduler = self.gateway.scheduler
        self.peer = PeerRole(host)
        self.jobs = JobViews(self.store, config.slice, lambda: self.endpoint)
        self.queries = SliceQueries(config, self.tpu, lambda: self.endpoint)
        self.streams = Slots(config.max_streams, "long-lived calls (attached runs, log "
                             "followers, uploads, results)",
                             "close some followers (logs(follow=True), `jobs logs -f`) or "
                             "start the agent with a larger --max-streams")
        self.peer_streams = Slots(_peer.STREAMS, "calls from gateways",
                                  "a gateway is sending more processes than one host runs")

    @property
    def endpoint(self) -> str:
        return join_host_port(self.address, self.port)

    def _env_for(self, spec: pb.JobSpec, process_id: int, coordinator: str) -> dict[str, str]:
        if num_slices(spec) > 1:
            why = disagreement(self.config.slice.megascale, num_slices=num_slices(spec),
                               slice_id=process_id // (num_processes(spec) // num_slices(spec)),
                               coordinator_host=host_of(coordinator))
            if why:
                raise ValueError(why)
        return {**worker_env(self._worker_base_env, spec=spec, process_id=process_id,
                             coordinator=coordinator,
                             simulate_devices=self.config.simulate_devices),
                **output_env(spec, self.state_dir, process_id),
                "REMOTE_TPU_GCS_CACHE": os.path.join(self.state_dir, "gcs-data")}

    def _spec(self, requests: Iterator[pb.RunRequest], context: grpc.ServicerContext,
              role: int | None) -> pb.JobSpec:
        return checked_spec(requests, context, endpoint=self.endpoint,
                            max_payload_bytes=self.config.max_payload_bytes, role=role)

    def _in_slot(self, slots: Slots, context: grpc.ServicerContext,
                 events: Iterator[pb.Event]) -> Iterator[pb.Event]:
        """``events``, streamed while holding one of ``slots`` (refused without one)."""
        release = slots.take(context, self.endpoint)
        try:
            yield from events
        finally:
            release()

    # ------------------------------------------------------------ RPCs

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        return self.queries.health()

    def Doctor(self, request: pb.DoctorRequest, context: grpc.ServicerContext
               ) -> pb.DoctorReply:
        if len(request.probe) > 4096:
            abort(context, Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                                   f"{len(request.probe)} addresses to probe: at most 4096"))
        return self.queries.doctor(list(request.hosts), list(request.probe))

    def Submit(self, request_iterator: Iterator[pb.RunRequest],
               context: grpc.ServicerContext) -> pb.JobStatus:
        release = self.streams.take(context, self.endpoint)
        try:
            spec = self._spec(request_iterator, context, pb.ROLE_GATEWAY)
            record, created = self.gateway.accept(spec, request_iterator, context)
        finally:
            release()
        status = status_of(record)
        status.existed = not created
        return status

    def Run(self, request_iterator: Iterator[pb.RunRequest],
            context: grpc.ServicerContext) -> Iterator[pb.Event]:
        spec = self._spec(request_iterator, context, None)
        if spec.role == pb.ROLE_PEER:
            yield from self._peer_call(request_iterator, context, spec)
        else:
            yield from self._in_slot(self.streams, context,
                                     self.gateway.run_attached(spec, request_iterator, context))

    def _peer_call(self, requests: Iterator[pb.RunRequest], context,
                   spec: pb.JobSpec | None = None) -> Iterator[pb.Event]:
        """This host's part of a gateway's job: from ``Run`` (its spec read), or a link."""
        if spec is None:
            spec = self._spec(requests, context, None)
            if spec.role != pb.ROLE_PEER:
                abort(context, Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                                       "a gateway's link carries its peers' calls only"))
        yield from self._in_slot(self.peer_streams, context,
                                 self.peer.run(spec, requests, context))

    def OpenLink(self, request: pb.LinkRequest, context: grpc.ServicerContext
                 ) -> pb.DataTicket:
        return offer_link(self.data_port, self._peer_call, self.queries.health,
                          self.config.peer_timeout)

    def RunInline(self, request: pb.RunRequest, context: grpc.ServicerContext
                  ) -> Iterator[pb.Event]:
        """Run, its one request carrying the spec and the payload inside it."""
        yield from self._run_inline(request, context, on_lane=False)

    def _run_inline(self, request: pb.RunRequest, context, on_lane: bool
                    ) -> Iterator[pb.Event]:
        """RunInline, from gRPC or a caller's lane (``wire.caller_lane``)."""
        spec = self._spec(iter((request,)), context, pb.ROLE_GATEWAY)
        if len(spec.payload) != spec.payload_size:
            abort(context, Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                f"RunInline carries its payload inside its JobSpec ({len(spec.payload)} of "
                f"{spec.payload_size} bytes there): a larger one is sent with Run"))
        events = self.gateway.run_attached(spec, iter(()), context)
        if spec.offer_lane and not on_lane:
            events = call_lane.offering(
                spec, events, self.data_port, self.scheduler.warm_owner,
                lambda request, context: self._run_inline(request, context, on_lane=True))
        yield from self._in_slot(self.streams, context, events)

    def HaveBlobs(self, request: pb.BlobQuery, context: grpc.ServicerContext
                  ) -> pb.BlobPresence:
        return pb.BlobPresence(present=[self.blobs.has(ref) for ref in request.blobs],
                               capacity=self.blobs.max_bytes)

    def OpenBlob(self, request: pb.BlobChunk, context: grpc.ServicerContext
                 ) -> pb.DataTicket:
        if self.data_port is None:
            return pb.DataTicket()
        if not request.HasField("blob"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "OpenBlob names a buffer")
        try:
            check_ref(request.blob)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.blob.size > self.blobs.max_bytes:
            return pb.DataTicket(refused=(
                f"a buffer of {request.blob.size:,} bytes is larger than its whole argument "
                f"cache (--cache-bytes {self.blobs.max_bytes:,})"))
        credentials, peers = self.config.peer_credentials, self._slice_peers
        ticket = self.data_port.issue(
            lambda sock: self.blobs.receive_raw(sock, request, credentials, peers))
        if ticket is None:
            return pb.DataTicket()
        return pb.DataTicket(port=self.data_port.port, nonce=self.data_port.nonce,
                             ticket=ticket)

    def _slice_peers(self) -> list[str]:
        """Every other agent of this slice, as its discovery found them."""
        found = self.config.slice
        return [p for i, p in enumerate(found.peers) if i != found.worker_id]

    def PutBlob(self, request_iterator: Iterator[pb.BlobChunk],
                context: grpc.ServicerContext) -> pb.BlobStored:
        release = self.streams.take(context, self.endpoint)
        try:
            return self.blobs.receive(request_iterator, self.config.peer_credentials,
                                      self._slice_peers)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            release()

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext
              ) -> Iterator[pb.Event]:
        record = self.jobs.known(request.job_id, context)
        hosts = list(request.hosts) or [0]
        count = max(1, num_processes(record.spec))
        bad = [h for h in hosts if h >= count]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"job {record.job_id} has processes 0-{count - 1}, not {bad[0]}")
        yield from self._in_slot(self.streams, context, watch(
            record, hosts, list(request.offsets), request.follow, context, with_end=True))

    def Result(self, request: pb.JobRef, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        record = self.jobs.known(request.job_id, context)
        if is_session(record):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{record.job_id} is a warm session's entry: it has no value of its "
                          "own (each call in it has its own job and value)")
        if not record.finished:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {record.job_id} has not finished yet")
        yield from self._in_slot(self.streams, context, result(
            record, self.data_port if request.data_port else None, request.value_in_end))

    def OutputFiles(self, request: pb.OutputsRequest, context: grpc.ServicerContext
                    ) -> Iterator[pb.OutputChunk]:
        if request.this_host:             # a gateway asking its peer for this host's part
            if not valid_job_id(request.job_id):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a job id")
            yield from own_files(self.state_dir, request.job_id)
            return
        record = self.jobs.known(request.job_id, context)
        if not record.finished:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {record.job_id} has not finished yet: its output files "
                          "are collected once it has")
        yield from self._in_slot(self.streams, context, slice_files(
            self.state_dir, record.spec, self.config.peer_credentials))

    def Status(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        return status_of(self.jobs.known(request.job_id, context))

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext
                 ) -> pb.ListJobsReply:
        return self.jobs.list(request.limit, context)

    def Cancel(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        record = self.jobs.known(request.job_id, context)
        if not record.finished:
            self.scheduler.cancel(record.job_id, "cancelled on request")
        return status_of(record)

    def Stacks(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.StacksReply:
        stacks = self.scheduler.stacks(request.job_id)
        if stacks is None:
            stacks = self.peer.stacks(request.job_id)
        if stacks is not None:
            return pb.StacksReply(hosts=bound_stacks(stacks))
        record = self.jobs.known(request.job_id, context)
        if is_session(record):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{record.job_id} is a warm session's entry: ask a call running in "
                          "it for its stacks (each call has its own job)")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"job {record.job_id} is not running "
                      f"({phase_name(record.status.phase)}): it has no stacks")

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext
                ) -> pb.ReleaseReply:
        detail = self.scheduler.release(
            "released by its caller, which ended" if request.client_id else
            "released by a caller", owner=request.client_id)
        if not detail:
            redirect = gateway_redirect(self.config.slice, self.endpoint)
            if redirect is not None:
                abort(context, redirect)
        return pb.ReleaseReply(released=bool(detail),
                               detail=detail or "the slice has no warm workers")

    # ------------------------------------------------------------ lifetime

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
        self.peer.stop_all()
        self.spares.stop()
        if self.data_port is not None:
            self.data_port.close()
        self.blobs.close()
        self.store.close()
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def _data_port(config: AgentConfig) -> DataPort | None:
    """Plain TCP has no TLS: an agent with TLS leaves bulk bytes to gRPC."""
    if config.tls_cert or config.data_port < 0:
        return None
    try:
        return DataPort(config.host, config.data_port)
    except OSError as exc:
        raise ConfigurationError(
            f"could not open the data port {config.host}:{config.data_port} ({exc}): "
            "choose another with --data-port, or none with --data-port -1") from exc


def create_server(config: AgentConfig) -> tuple[grpc.Server, int, AgentService]:
    """Build (not start) the agent's server; port 0 binds an ephemeral port."""
    options = channel_options({
        "grpc.max_concurrent_streams": config.max_streams + _peer.STREAMS + RESERVE_THREADS,
        # Notice a vanished caller within ~2.5 s: its attached job is then cancelled.
        "grpc.keepalive_time_ms": 1000,
        "grpc.keepalive_timeout_ms": 1500,
        "grpc.http2.min_recv_ping_interval_without_data_ms": 400,
        "grpc.http2.min_sent_ping_interval_without_data_ms": 1000,
        "grpc.http2.max_ping_strikes": 0,
    })
    service = AgentService(config)
    interceptors = [TokenInterceptor(config.token, service.refusals)] if config.token else []
    # Every stream slot has its thread, and short calls keep a reserve of their own.
    threads = config.max_streams + _peer.STREAMS + RESERVE_THREADS
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="rpc"),
                         options=options, interceptors=interceptors,
                         maximum_concurrent_rpcs=threads + 64)
    pb_grpc.add_AgentServicer_to_server(service, server)
    address = join_host_port(config.host, config.port)
    if config.tls_cert:
        port = server.add_secure_port(address, config.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    service.port = port
    # After the gRPC port: a free port the kernel picks can then never be it.
    service.data_port = _data_port(config)
    return server, port, service
