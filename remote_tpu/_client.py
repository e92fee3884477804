"""One blocking call: payload up to the gateway, events back, outcome out."""

from __future__ import annotations

import hashlib
import re
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import tenacity

from ._cloud import is_tpu_url
from ._cloud import resolve as resolve_tpu
from ._exceptions import AgentUnavailableError, ConfigurationError, SerializationError
from ._local_slice import get_local_slice
from ._options import RunOptions
from ._outcome import raise_for_end
from ._proto import remote_tpu_pb2 as pb
from ._proto import remote_tpu_pb2_grpc as pb_grpc
from ._render import OutputRenderer
from ._serialization import Payload, loads
from ._topology import Topology
from ._transport import Credentials, Redirect, error_from_rpc, shared_channel, versions_pb

_STREAM_MODES = {"leader": pb.STREAM_MODE_LEADER, "all": pb.STREAM_MODE_ALL,
                 "none": pb.STREAM_MODE_NONE}
_RETRY_SECONDS = 15.0                       # see _retrying
_SUBMIT_BASE_SECONDS = 600.0                # see upload_deadline
_SLOWEST_UPLOAD_BYTES_PER_SECOND = 1_000_000


def new_job_id(name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:40].strip("-._") or "job"
    return f"{stem}-{uuid.uuid4().hex[:12]}"


def _requests(spec: pb.JobSpec, payload: Payload) -> Iterator[pb.RunRequest]:
    yield pb.RunRequest(spec=spec)
    for chunk in payload.chunks():
        yield pb.RunRequest(payload_chunk=chunk)


def _target(options: RunOptions) -> tuple[str, list[str], Credentials]:
    """(gateway address, host list for the spec, credentials) for these options."""
    if options.local:
        local = get_local_slice(options.topology)
        return local.addresses[0], list(local.addresses), local.credentials
    hosts = list(options.hosts)
    if is_tpu_url(hosts[0]):
        hosts, accelerator = resolve_tpu(hosts[0])
        if accelerator and Topology.parse(accelerator).name != options.topology.name:
            t = Topology.parse(accelerator)
            raise ConfigurationError(
                f"asked for {options.topology.name}, {options.topology.hosts} host(s); "
                f"{options.hosts[0]} is {accelerator}, {t.hosts} host(s)")
    credentials = Credentials.for_client(options.token, options.tls)
    return hosts[0], (hosts if len(hosts) > 1 else []), credentials


def _spec(options: RunOptions, payload: Payload, job_id: str, hosts: list[str]) -> pb.JobSpec:
    topology = options.topology
    jt = options.jax_timeouts
    return pb.JobSpec(
        client_versions=versions_pb(), job_id=job_id, accelerator=topology.name,
        num_hosts=topology.hosts, role=pb.ROLE_GATEWAY, hosts=hosts,
        stream=_STREAM_MODES[options.stream], env=dict(options.env),
        timeout_seconds=options.timeout or 0.0,
        jax_timeouts=pb.JaxTimeouts(initialization_seconds=jt.initialization,
                                    heartbeat_seconds=jt.heartbeat,
                                    shutdown_seconds=jt.shutdown),
        payload_size=payload.nbytes, devices_per_host=topology.devices_per_host,
        payload_sha256=payload.sha256(), processes_per_host=options.processes_per_host,
    )


def call(options: RunOptions, payload: Payload, job_id: str) -> Any:
    """Run attached: output shown live, the value returned; the job is cancelled
    on every host if this call is interrupted or this process goes away."""
    gateway, hosts, credentials = _target(options)
    spec = _spec(options, payload, job_id, hosts)
    try:
        return _attached(gateway, spec, payload, credentials, options)
    except Redirect as redirect:        # any host can answer: go to worker 0
        return _attached(redirect.address, spec, payload, credentials, options)


def _attached(gateway: str, spec: pb.JobSpec, payload: Payload, credentials: Credentials,
              options: RunOptions) -> Any:
    stub = pb_grpc.AgentStub(shared_channel(gateway, credentials))
    try:
        stream = _retrying(gateway)(_start_run, stub, spec, payload, credentials)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, gateway) from None
    label = "process" if options.processes_per_host > 1 else "host"
    return outcome(stream, OutputRenderer(options.stream, label), gateway=gateway,
                   job_id=spec.job_id,
                   accelerator=options.topology.name)


class _StartedRun:
    """A Run stream whose first event was read already, handed on with it."""

    def __init__(self, stream: Any, first: pb.Event | None) -> None:
        self._stream = stream
        self._first = first

    def __iter__(self) -> Iterator[pb.Event]:
        if self._first is not None:
            yield self._first
        yield from self._stream

    def cancel(self) -> None:
        self._stream.cancel()


def _start_run(stub: pb_grpc.AgentStub, spec: pb.JobSpec, payload: Payload,
               credentials: Credentials) -> _StartedRun:
    """One attempt at Run, up to its first event. ``stub.Run`` only starts the
    call: a refused connection surfaces when the stream is first read, so that
    read belongs to the attempt; once an event has arrived, nothing is retried.
    Each attempt sends the payload from its start."""
    stream = stub.Run(_requests(spec, payload), metadata=credentials.metadata)
    try:
        first = next(stream, None)
    except BaseException:
        stream.cancel()          # Ctrl-C before the first event: the job stops too
        raise
    return _StartedRun(stream, first)


def submit(options: RunOptions, payload: Payload, job_id: str):
    """Queue the job and return its handle at once; retried on transient faults
    only, which cannot start it twice (the agent knows the job id)."""
    from ._jobs import JobHandle

    gateway, hosts, credentials = _target(options)
    spec = _spec(options, payload, job_id, hosts)
    try:
        _submit(gateway, spec, payload, credentials)
    except Redirect as redirect:
        gateway = redirect.address
        _submit(gateway, spec, payload, credentials)
    return JobHandle(job_id, gateway=gateway, credentials=credentials,
                     accelerator=options.topology.name, local=options.local)


def _submit(gateway: str, spec: pb.JobSpec, payload: Payload, credentials: Credentials) -> None:
    stub = pb_grpc.AgentStub(shared_channel(gateway, credentials))
    deadline = upload_deadline(payload.nbytes)
    try:
        _retrying(gateway)(lambda: stub.Submit(_requests(spec, payload),
                                               metadata=credentials.metadata,
                                               timeout=deadline))
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, gateway) from None


def upload_deadline(payload_size: int) -> float:
    """Seconds Submit may take to upload ``payload_size`` bytes and be answered.

    Keepalive pings (see ``_transport.channel_options``) already end a call
    whose connection or agent host is gone; a deadline is still what ends one
    whose agent is alive but no longer reads (a full or hung disk, a bug),
    since gRPC answers pings by itself. A fixed deadline would fail the largest
    payloads on slow links (16 GiB in 600 s needs 28 MB/s), so it grows with the
    payload: 600 s, plus 1 s per MB (16 GiB: about 5 hours)."""
    return _SUBMIT_BASE_SECONDS + payload_size / _SLOWEST_UPLOAD_BYTES_PER_SECOND


def _retrying(gateway: str) -> tenacity.Retrying:
    """The retries of a call that the agent has not answered yet (Submit, and Run
    before its first event), safe because the agent takes a job id only once.

    Only UNAVAILABLE is retried (nothing answered: the agent is restarting, or
    the connection dropped before any reply), never another status. The budget
    counts from the call's first attempt, so a call that failed after running
    for long is not sent again. The channel backs off its own reconnects
    (``_transport.channel_options``: from 0.25 s up to 2 s), and an attempt
    reaches an agent only after the channel's next try, so an agent back within
    about 13 s is reached. No agent at all is reported after about 16 s."""
    return tenacity.Retrying(
        stop=tenacity.stop_after_delay(_RETRY_SECONDS), reraise=True,
        wait=tenacity.wait_exponential(multiplier=0.25, max=2),
        retry=tenacity.retry_if_exception(_unavailable),
        before_sleep=lambda state: _retry_notice(gateway, state))


_TLS_WORDS = ("ssl", "handshake", "certificate", "tsi_")


def _unavailable(exc: BaseException) -> bool:
    """No connection could be made, so nothing reached the agent: it is not
    listening (yet), as while it restarts, or an SSH tunnel to it accepted and
    closed. Not a TLS failure, which asking again would not mend."""
    if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = (exc.details() or "").lower()
    return "failed to connect to all addresses" in details and \
        not any(word in details for word in _TLS_WORDS)


def _retry_notice(gateway: str, state: tenacity.RetryCallState) -> None:
    if state.attempt_number == 1:        # once per call, not once per attempt
        print(f"remote_tpu: no agent answered at {gateway}; retrying for up to "
              f"{_RETRY_SECONDS:.0f} s (if it is not restarting, check that "
              "`remote-tpu-agent` runs there)", file=sys.stderr, flush=True)


def outcome(stream, renderer: OutputRenderer, *, gateway: str, job_id: str,
            accelerator: str) -> Any:
    """Consume a Run or Result stream: show output, then return the value or
    raise what the caller should see."""
    chunks: list[bytes] = []
    end: pb.JobEnd | None = None
    try:
        for event in stream:
            kind = event.WhichOneof("kind")
            if kind == "output":
                renderer.write(event.host, event.output.stream, event.output.data)
            elif kind == "result_chunk":
                chunks.append(event.result_chunk)
            elif kind == "end":
                end = event.end
            elif kind == "queued":
                q = event.queued
                print(f"remote_tpu: job {job_id} is queued behind job {q.queued_behind} "
                      f"(position {q.queue_position}) on {accelerator}", file=sys.stderr,
                      flush=True)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, gateway) from None
    except BaseException:
        stream.cancel()          # Ctrl-C: the gateway stops every host
        raise
    finally:
        renderer.close()
    if end is None:
        raise AgentUnavailableError(f"the agent at {gateway} ended job {job_id} without a "
                                    "final report; see its log")
    raise_for_end(end, accelerator=accelerator, job_id=job_id)
    data = bytearray(sum(len(c) for c in chunks))
    digest = hashlib.sha256()
    pos = 0
    for c in chunks:
        data[pos:pos + len(c)] = c
        digest.update(c)
        pos += len(c)
    chunks.clear()
    if digest.digest() != end.result_sha256:
        raise SerializationError(f"the return value of job {job_id} arrived corrupted (its "
                                 "SHA-256 does not match the gateway's); nothing was "
                                 "unpickled. Call again.")
    return loads(data, what="return value")
