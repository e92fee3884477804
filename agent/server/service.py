"""The agent's gRPC service: a thin servicer that maps each RPC to the object
that does the work (the agent's parts: ``server.parts``), and ``create_server``
that builds both.

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
from collections.abc import Iterator

import grpc

from remote_tpu._core.addresses import join_host_port
from remote_tpu._core.channels import channel_options
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._core.states import phase_name

from remote_tpu_agent.gateway.reports import bound_stacks
from remote_tpu_agent.gateway.warm import is_session
from remote_tpu_agent.host.blobs import check_ref
from remote_tpu_agent.host.config import AgentConfig
from remote_tpu_agent.host.output_dir import own_files, slice_files
from remote_tpu_agent.jobs.requests import (Refused, abort, checked_spec, gateway_redirect,
                                            valid_job_id)
from remote_tpu_agent.jobs.views import merged, result, status_of, watch
from remote_tpu_agent.peer import role as _peer
from remote_tpu_agent.server.guard import Refusals, TokenInterceptor
from remote_tpu_agent.server.parts import AgentParts
from remote_tpu_agent.server.slots import RESERVE_THREADS, Slots
from remote_tpu_agent.wire import caller_lane as call_lane
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu_agent.wire.peer_link_server import offer_link
from remote_tpu_agent.worker.environment import num_processes

log = logging.getLogger(__name__)


class AgentService(pb_grpc.AgentServicer):
    """The RPCs, each mapped onto the agent's parts (``server.parts``); the
    stream slots that keep short calls answering are the server's own.

    Why over 200 lines: one short method per RPC of the service (twenty of
    them); split, one RPC table would live in several classes.
    """

    def __init__(self, parts: AgentParts) -> None:
        self.parts = parts
        self.refusals = Refusals()       # calls refused for their token, by peer
        self.streams = Slots(parts.config.max_streams, "long-lived calls (attached runs, log "
                             "followers, uploads, results)",
                             "close some followers (logs(follow=True), `jobs logs -f`) or "
                             "start the agent with a larger --max-streams")
        self.peer_streams = Slots(_peer.STREAMS, "calls from gateways",
                                  "a gateway is sending more processes than one host runs")

    def _spec(self, requests: Iterator[pb.RunRequest], context: grpc.ServicerContext,
              role: int | None) -> pb.JobSpec:
        return checked_spec(requests, context, endpoint=self.parts.endpoint,
                            max_payload_bytes=self.parts.config.max_payload_bytes, role=role)

    def _in_slot(self, slots: Slots, context: grpc.ServicerContext,
                 events: Iterator[pb.Event]) -> Iterator[pb.Event]:
        """``events``, streamed while holding one of ``slots`` (refused without one)."""
        release = slots.take(context, self.parts.endpoint)
        try:
            yield from events
        finally:
            release()

    # ------------------------------------------------------------ RPCs

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        return self.parts.queries.health()

    def Doctor(self, request: pb.DoctorRequest, context: grpc.ServicerContext
               ) -> pb.DoctorReply:
        if len(request.probe) > 4096:
            abort(context, Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                                   f"{len(request.probe)} addresses to probe: at most 4096"))
        return self.parts.queries.doctor(list(request.hosts), list(request.probe))

    def Submit(self, request_iterator: Iterator[pb.RunRequest],
               context: grpc.ServicerContext) -> pb.JobStatus:
        release = self.streams.take(context, self.parts.endpoint)
        try:
            spec = self._spec(request_iterator, context, pb.ROLE_GATEWAY)
            record, created = self.parts.gateway.accept(spec, request_iterator, context)
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
            yield from self._in_slot(self.streams, context, self.parts.gateway.run_attached(
                spec, request_iterator, context))

    def _peer_call(self, requests: Iterator[pb.RunRequest], context,
                   spec: pb.JobSpec | None = None) -> Iterator[pb.Event]:
        """This host's part of a gateway's job: from ``Run`` (its spec read), or a link."""
        if spec is None:
            spec = self._spec(requests, context, None)
            if spec.role != pb.ROLE_PEER:
                abort(context, Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                                       "a gateway's link carries its peers' calls only"))
        yield from self._in_slot(self.peer_streams, context,
                                 self.parts.peer.run(spec, requests, context))

    def OpenLink(self, request: pb.LinkRequest, context: grpc.ServicerContext
                 ) -> pb.DataTicket:
        return offer_link(self.parts.data_port, self._peer_call, self.parts.queries.health,
                          self.parts.config.peer_timeout)

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
        events = self.parts.gateway.run_attached(spec, iter(()), context)
        if spec.offer_lane and not on_lane:
            events = call_lane.offering(
                spec, events, self.parts.data_port, self.parts.scheduler.warm_owner,
                lambda request, context: self._run_inline(request, context, on_lane=True))
        yield from self._in_slot(self.streams, context, events)

    def HaveBlobs(self, request: pb.BlobQuery, context: grpc.ServicerContext
                  ) -> pb.BlobPresence:
        return pb.BlobPresence(present=[self.parts.blobs.has(ref) for ref in request.blobs],
                               capacity=self.parts.blobs.max_bytes)

    def OpenBlob(self, request: pb.BlobChunk, context: grpc.ServicerContext
                 ) -> pb.DataTicket:
        if self.parts.data_port is None:
            return pb.DataTicket()
        if not request.HasField("blob"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "OpenBlob names a buffer")
        try:
            check_ref(request.blob)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.blob.size > self.parts.blobs.max_bytes:
            return pb.DataTicket(refused=(
                f"a buffer of {request.blob.size:,} bytes is larger than its whole argument "
                f"cache (--cache-bytes {self.parts.blobs.max_bytes:,})"))
        self.parts.idle.touch()          # a call's large arguments: the call follows
        credentials, peers = self.parts.config.peer_credentials, self.parts.slice_peers
        ticket = self.parts.data_port.issue(
            lambda sock: self.parts.blobs.receive_raw(sock, request, credentials, peers))
        if ticket is None:
            return pb.DataTicket()
        return pb.DataTicket(port=self.parts.data_port.port, nonce=self.parts.data_port.nonce,
                             ticket=ticket)

    def PutBlob(self, request_iterator: Iterator[pb.BlobChunk],
                context: grpc.ServicerContext) -> pb.BlobStored:
        release = self.streams.take(context, self.parts.endpoint)
        try:
            with self.parts.idle.hold():
                return self.parts.blobs.receive(request_iterator,
                                                self.parts.config.peer_credentials,
                                                self.parts.slice_peers)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            release()

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext
              ) -> Iterator[pb.Event]:
        record = self.parts.jobs.known(request.job_id, context)
        hosts = list(request.hosts) or [0]
        count = max(1, num_processes(record.spec))
        bad = [h for h in hosts if h >= count]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"job {record.job_id} has processes 0-{count - 1}, not {bad[0]}")
        if request.merged and not request.follow:
            events = merged(record, hosts, request.since)
        else:
            events = watch(record, hosts, list(request.offsets), request.follow, context,
                           with_end=True, since=request.since)
        yield from self._in_slot(self.streams, context, events)

    def Result(self, request: pb.JobRef, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        record = self.parts.jobs.known(request.job_id, context)
        if is_session(record):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{record.job_id} is a warm session's entry: it has no value of its "
                          "own (each call in it has its own job and value)")
        if not record.finished:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {record.job_id} has not finished yet")
        yield from self._in_slot(self.streams, context, result(
            record, self.parts.data_port if request.data_port else None, request.value_in_end))

    def OutputFiles(self, request: pb.OutputsRequest, context: grpc.ServicerContext
                    ) -> Iterator[pb.OutputChunk]:
        if request.this_host:             # a gateway asking its peer for this host's part
            if not valid_job_id(request.job_id):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a job id")
            yield from own_files(self.parts.state_dir, request.job_id)
            return
        record = self.parts.jobs.known(request.job_id, context)
        if not record.finished:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {record.job_id} has not finished yet: its output files "
                          "are collected once it has")
        yield from self._in_slot(self.streams, context, slice_files(
            self.parts.state_dir, record.spec, self.parts.config.peer_credentials))

    def Status(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        return self.parts.jobs.status(request.job_id, context, self.parts.scheduler.metrics)

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext
                 ) -> pb.ListJobsReply:
        return self.parts.jobs.list(request.limit, context)

    def Cancel(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        record = self.parts.jobs.known(request.job_id, context)
        if not record.finished and request.interrupt:
            self.parts.scheduler.interrupt(record.job_id, "interrupted by its caller")
        elif not record.finished:
            self.parts.scheduler.cancel(record.job_id, "cancelled on request")
        return status_of(record)

    def Stacks(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.StacksReply:
        stacks = self.parts.scheduler.stacks(request.job_id)
        if stacks is None:
            stacks = self.parts.peer.stacks(request.job_id)
        if stacks is not None:
            return pb.StacksReply(hosts=bound_stacks(stacks))
        record = self.parts.jobs.known(request.job_id, context)
        if is_session(record):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{record.job_id} is a warm session's entry: ask a call running in "
                          "it for its stacks (each call has its own job)")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"job {record.job_id} is not running "
                      f"({phase_name(record.status.phase)}): it has no stacks")

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext
                ) -> pb.ReleaseReply:
        detail = self.parts.scheduler.release(
            "released by its caller, which ended" if request.client_id else
            "released by a caller", owner=request.client_id)
        if not detail:
            redirect = gateway_redirect(self.parts.config.slice, self.parts.endpoint)
            if redirect is not None:
                abort(context, redirect)
        return pb.ReleaseReply(released=bool(detail),
                               detail=detail or "the slice has no warm workers")

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
    parts = AgentParts(config)
    service = AgentService(parts)
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
    parts.port = port
    # After the gRPC port: a free port the kernel picks can then never be it.
    parts.data_port = _data_port(config)
    return server, port, service
