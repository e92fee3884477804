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
    stream = stub.Run(_requests(spec, payload), metadata=credentials.metadata)
    label = "process" if options.processes_per_host > 1 else "host"
    return outcome(stream, OutputRenderer(options.stream, label), gateway=gateway,
                   job_id=spec.job_id,
                   accelerator=options.topology.name)


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
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(4), reraise=True,
        wait=tenacity.wait_exponential(multiplier=0.25, max=2),
        retry=tenacity.retry_if_exception(
            lambda e: isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE))
    try:
        retrying(lambda: stub.Submit(_requests(spec, payload), metadata=credentials.metadata,
                                     timeout=600))
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, gateway) from None


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
