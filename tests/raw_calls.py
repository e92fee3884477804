"""Calls to an agent below the client, shared by the tiers that test what an
agent refuses: hand-made job specs, a raw ``Run``, the error a refused one
ends with, a data-port ticket, and a function that leaves a mark on every
host it ran on."""

from __future__ import annotations

import os
import time

import grpc
import pytest

import remote_tpu
from remote_tpu._core import digests
from remote_tpu._core.auth import TOKEN_METADATA_KEY
from remote_tpu._core.channels import Credentials, error_from_rpc, stub
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._core.versions import versions_pb


def probe_spec(**overrides) -> pb.JobSpec:
    """A gateway job "probe" with no payload (``python=`` sets the client's)."""
    spec = pb.JobSpec(client_versions=versions_pb(), job_id="probe",
                      accelerator="tpu-v5litepod-4", payload_digest=bytes(16),
                      stream=pb.STREAM_MODE_LEADER,
                      role=pb.ROLE_GATEWAY)
    for key, value in overrides.items():
        if key == "python":
            spec.client_versions.python = value
        else:
            setattr(spec, key, value)
    return spec


def refusal(address: str, spec: pb.JobSpec, token: str) -> remote_tpu.RemoteTPUError:
    """The client's error for ``spec``, which the agent at ``address`` refuses."""
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.AgentStub(ch).Run(iter([pb.RunRequest(spec=spec)]),
                                           metadata=((TOKEN_METADATA_KEY, token),)))
    return error_from_rpc(info.value, address)


def raw_stub(address):
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.AgentStub(channel)


def run_raw(address, token, requests):
    """Every event of a ``Run`` made of ``requests``."""
    channel, stub = raw_stub(address)
    with channel:
        return list(stub.Run(iter(requests), metadata=((TOKEN_METADATA_KEY, token),)))


def payload_spec(payload: bytes, **fields) -> pb.JobSpec:
    """A gateway job of its own id that announces ``payload``."""
    spec = pb.JobSpec(client_versions=versions_pb(), job_id=f"raw-{time.monotonic_ns()}",
                      accelerator="tpu-v5litepod-4", role=pb.ROLE_GATEWAY,
                      stream=pb.STREAM_MODE_LEADER, payload_size=len(payload),
                      payload_digest=digests.of(payload))
    for k, v in fields.items():
        setattr(spec, k, v)
    return spec


def blob_ticket(agents, size: int, digest: bytes | None = None) -> pb.DataTicket:
    """A ticket for the data port of ``agents``' first agent, to send a
    buffer of ``size`` bytes (of a random digest unless given)."""
    data_ref = pb.BlobRef(digest=digest or os.urandom(digests.SIZE), size=size)
    creds = Credentials(token=agents.token)
    return stub(agents.addresses[0], creds).OpenBlob(
        pb.BlobChunk(blob=data_ref), metadata=creds.metadata, timeout=30)


def marks(tmp_path):
    """The marks ``marking``'s function left in ``tmp_path``."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ran-on-"))


def marking(tmp_path, **run_kwargs):
    """``remote_tpu.run(**run_kwargs)`` of a function that marks its host."""
    @remote_tpu.run(**run_kwargs)
    def leave_mark():
        import jax
        (tmp_path / f"ran-on-{jax.process_index()}").touch()
        return "ran"
    return leave_mark
