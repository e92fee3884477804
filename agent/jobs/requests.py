"""What the agent checks in a request before acting on it, and how it says no.

Every refusal carries a gRPC status, a kind in the trailing metadata (which the
client turns into its own error type: ``channels.error_from_rpc``) and a
message that says what was wrong and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NoReturn

import grpc

from remote_tpu._core import digests
from remote_tpu._core.channels import ERROR_KIND_KEY
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.limits import DETAIL_CHARS, cut_text
from remote_tpu._core.multislice import MAX_SLICES
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.topology import Topology
from remote_tpu._core.versions import check_compatible

from remote_tpu_agent.wire.discovery import Slice
from remote_tpu_agent.worker.environment import num_processes

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")     # fullmatch only


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, kind: str, message: str) -> None:
        super().__init__(message)
        self.code, self.kind, self.message = code, kind, message


def abort(context: grpc.ServicerContext, refused: Refused) -> NoReturn:
    context.set_trailing_metadata(((ERROR_KIND_KEY, refused.kind),))
    # Status details travel as metadata: gRPC refuses more than 16 KiB of it.
    context.abort(refused.code, cut_text(refused.message, DETAIL_CHARS))
    raise AssertionError("unreachable")


def valid_job_id(job_id: str) -> bool:
    """1-64 letters, digits, '.', '_' or '-', starting with a letter or digit
    (a job id names a directory)."""
    return _JOB_ID.fullmatch(job_id) is not None


def checked_spec(requests: Iterator[pb.RunRequest], context: grpc.ServicerContext, *,
                 endpoint: str, max_payload_bytes: int, role: int | None) -> pb.JobSpec:
    """The job spec a Run or Submit call starts with (``role``: the one this
    call takes, None for either), or the call is aborted saying what is wrong."""
    try:
        spec = _read_spec(requests, endpoint, max_payload_bytes)
        if role is not None and spec.role != role:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                          "Submit and RunInline take gateway jobs only (a gateway calls "
                          "each of its peers with Run)")
        return spec
    except Refused as r:
        abort(context, r)


def _read_spec(requests: Iterator[pb.RunRequest], endpoint: str,
               max_payload_bytes: int) -> pb.JobSpec:
    first = next(requests, None)
    if first is None or not first.HasField("spec"):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                      "a Run call must start with a JobSpec")
    spec = first.spec
    try:
        check_compatible(spec.client_versions, sender="this client",
                         receiver=f"the agent at {endpoint}", interpreter=False)
    except Exception as exc:  # noqa: BLE001 - VersionMismatchError, reported as it is
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "version", str(exc)) from None
    if not valid_job_id(spec.job_id):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                      f"job id {cut_text(spec.job_id, 200)!r} is not valid: use 1-64 letters, "
                      "digits, '.', '_' or '-', starting with a letter or digit")
    if spec.payload_size > max_payload_bytes:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "config",
                      f"payload of {spec.payload_size} bytes is over this agent's limit of "
                      f"{max_payload_bytes} bytes")
    if spec.role not in (pb.ROLE_GATEWAY, pb.ROLE_PEER):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol", f"unknown role {spec.role}")
    if spec.stream not in (pb.STREAM_MODE_LEADER, pb.STREAM_MODE_ALL, pb.STREAM_MODE_NONE):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                      f"unknown stream mode {spec.stream}")
    if len(spec.payload_digest) != digests.SIZE:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                      f"the job spec carries no {digests.NAME} digest of its payload")
    if spec.HasField("retries") and not _sane(spec.retries):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                      f"retries= allows at most {MAX_RETRIES} retries in all, each wait at "
                      f"most {MAX_BACKOFF:g} s; got {spec.retries}".replace("\n", " "))
    if spec.num_slices > MAX_SLICES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                      f"num_slices={spec.num_slices} is over the limit of {MAX_SLICES}")
    if spec.role == pb.ROLE_PEER and not (
            0 < spec.process_id < num_processes(spec) and spec.coordinator_address):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                      f"peer job needs 0 < process_id < num_hosts and a coordinator; got "
                      f"process {spec.process_id} of {spec.num_hosts}, coordinator "
                      f"{spec.coordinator_address!r}")
    return spec


MAX_RETRIES, MAX_BACKOFF = 200, 86400.0


def _sane(r: pb.RetryPolicy) -> bool:
    return r.preemptions + r.failures <= MAX_RETRIES and \
        0 <= r.backoff_seconds <= MAX_BACKOFF and 0 <= r.backoff_max_seconds <= MAX_BACKOFF


def gateway_redirect(found: Slice, endpoint: str) -> Refused | None:
    """When this agent is not worker 0 of a slice it knows, the refusal that
    sends the client to worker 0 (any host can be asked; the client follows)."""
    if not found.peers or found.worker_id == 0:
        return None
    return Refused(grpc.StatusCode.FAILED_PRECONDITION, f"redirect {found.peers[0]}",
                   f"the agent at {endpoint} is worker {found.worker_id} of its slice; the "
                   f"gateway is worker 0 at {found.peers[0]}")


def hosts_for(spec: pb.JobSpec, found: Slice, endpoint: str) -> list[str]:
    """Every host of a gateway job, first = this one: the client's list, else
    this slice's peers; refused when they do not fit the accelerator."""
    try:
        topology = Topology.parse(spec.accelerator)
    except ValueError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config", str(exc)) from None
    if spec.num_slices > 1:
        return _multislice_hosts(spec, topology)
    if not spec.hosts:
        redirect = gateway_redirect(found, endpoint)
        if redirect is not None:
            raise redirect
        if found.accelerator:
            try:
                topology.check_same(found.accelerator, f"this slice (from its {found.source})")
            except ConfigurationError as exc:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "config", str(exc)) from None
    hosts = list(spec.hosts) or list(found.peers) or [endpoint]
    try:
        if spec.hosts:
            topology.check_host_count(hosts, "the job's host list")
        else:
            topology.check_host_count(
                hosts, f"the slice behind the agent at {endpoint}",
                "Use the accelerator this slice really is (`remote-tpu-agent --print-slice` "
                "on a host shows what its agent found: its --peers, or its metadata), or "
                "give hosts= every host's address, worker 0 first.")
    except ConfigurationError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config", str(exc)) from None
    return hosts


def _multislice_hosts(spec: pb.JobSpec, topology: Topology) -> list[str]:
    """A multislice job's hosts: the client lists every slice's, slice by
    slice (it asked each slice's gateway for its own); this agent is the first."""
    slices = spec.num_slices
    want = topology.hosts * slices
    if len(spec.hosts) != want:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                      f"a job on {slices} slices of {topology.name} runs on {want} hosts "
                      f"({topology.hosts} per slice), but its host list has "
                      f"{len(spec.hosts)}: list every slice's hosts, slice by slice")
    if len(set(spec.hosts)) != len(spec.hosts):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "config",
                      "the job's slices share a host: " + ", ".join(spec.hosts))
    return list(spec.hosts)
