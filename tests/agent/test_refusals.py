"""What an agent's servicer answers, and refuses with a message that says why,
before anything runs: health, a client Python no host has, job ids that could
leave the state directory, a peer's call without its coordinator, payloads
that are not what they announce, RunInline misused. The agents are servicers
in this process (``servicers``): no test here starts a process."""

from __future__ import annotations

import os
import sys

import grpc
import pytest

import remote_tpu
from conftest import Servicers
from raw_calls import payload_spec, probe_spec, refusal, run_raw
from remote_tpu._core import digests
from remote_tpu._core.channels import Credentials, error_from_rpc, health, stub
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc


def test_health_reports_versions_and_slice(servicers):
    address = servicers.addresses[1]
    credentials = Credentials(token=servicers.token)
    reply = health(address, credentials)
    assert reply.versions.remote_tpu == remote_tpu.__version__
    assert reply.worker_id == 1 and list(reply.peers) == servicers.addresses
    assert reply.simulate_devices == 2


def test_a_client_python_no_host_has_is_refused_naming_both_versions(servicers):
    err = refusal(servicers.addresses[0], probe_spec(python="3.4.10", accelerator="tpu-v4-16"),
                  servicers.token)
    assert isinstance(err, remote_tpu.VersionMismatchError)
    ours = f"3.{sys.version_info.minor}"
    assert f"the client runs Python 3.4 and this host's agent Python {ours}" in str(err)
    assert "`uv python install 3.4`" in str(err) and "--python" in str(err)


@pytest.mark.parametrize("job_id", ["../../etc", "", "a/b", "x" * 65])
def test_job_ids_that_could_escape_the_state_dir_are_refused(servicers, job_id):
    err = refusal(servicers.addresses[0], probe_spec(job_id=job_id), servicers.token)
    assert isinstance(err, remote_tpu.ConfigurationError) and "job id" in str(err)


def test_peer_without_coordinator_is_refused(servicers):
    err = refusal(servicers.addresses[1], probe_spec(role=pb.ROLE_PEER, process_id=1,
                                                     num_hosts=2), servicers.token)
    assert "coordinator" in str(err)


def test_wrong_digest_truncated_and_oversize_payloads_are_refused(servicer_factory):
    lone_agent = servicer_factory(1, peers=False)
    address, token = lone_agent.addresses[0], lone_agent.token
    payload = b"x" * 1000
    cases = [
        ([pb.RunRequest(spec=payload_spec(payload, payload_digest=bytes(16))),
          pb.RunRequest(payload_chunk=payload)], "does not match its xxh3-128 digest"),
        ([pb.RunRequest(spec=payload_spec(payload)), pb.RunRequest(payload_chunk=payload[:10])],
         "payload truncated: got 10 of 1000 bytes"),
        ([pb.RunRequest(spec=payload_spec(payload)), pb.RunRequest(payload_chunk=payload * 2)],
         "longer than the announced 1000 bytes"),
        ([pb.RunRequest(spec=payload_spec(payload, payload_size=1 << 40))],
         "over this agent's limit"),
        ([pb.RunRequest(spec=payload_spec(payload, stream=77))], "unknown stream mode 77"),
        ([pb.RunRequest(spec=payload_spec(payload, role=9))], "unknown role 9"),
        ([pb.RunRequest(payload_chunk=payload)], "must start with a JobSpec"),
        ([pb.RunRequest(spec=payload_spec(payload, payload_digest=b""))], "no xxh3-128 digest"),
    ]
    refused_ids = set()
    for requests, message in cases:
        if requests[0].HasField("spec"):
            refused_ids.add(requests[0].spec.job_id)
        with pytest.raises(grpc.RpcError) as info:
            run_raw(address, token, requests)
        assert message in str(error_from_rpc(info.value, address)), message
    with pytest.raises(grpc.RpcError) as info:    # one message over the size limit
        run_raw(address, token, [pb.RunRequest(payload_chunk=b"y" * (5 << 20))])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    state = lone_agent.state_dirs[0]
    kept = {name.rsplit(".", 1)[0] for name in os.listdir(os.path.join(state, "jobs"))}
    assert not kept & refused_ids, "a refused job left a record"
    assert not os.listdir(os.path.join(state, "incoming")), "a refused payload was left"


def test_client_payload_over_the_agents_limit_says_so(servicer_factory):
    agents = servicer_factory(1, peers=False, max_payload_bytes=100000)
    f = remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                       token=agents.token)(len)
    with pytest.raises(remote_tpu.ConfigurationError, match="over this agent's limit of "
                                                            "100000 bytes"):
        f(b"z" * 200_000)


def _run_inline(agents: Servicers, spec: pb.JobSpec) -> grpc.RpcError:
    credentials = Credentials(token=agents.token)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub(agents.addresses[0], credentials).RunInline(
            pb.RunRequest(spec=spec), metadata=credentials.metadata))
    return raised.value


def test_run_inline_refuses_a_peer_s_call_and_a_payload_not_inside(servicer_factory):
    agents = servicer_factory(1, peers=False)
    from remote_tpu._core.versions import versions_pb

    spec = pb.JobSpec(client_versions=versions_pb(), job_id="inline-peer",
                      accelerator="tpu-v5litepod-8", num_hosts=2, role=pb.ROLE_PEER,
                      process_id=1, coordinator_address="127.0.0.1:1",
                      stream=pb.STREAM_MODE_NONE, payload_size=3,
                      payload_digest=b"\0" * digests.SIZE, payload=b"abc")
    error = _run_inline(agents, spec)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "gateway jobs only" in error.details()

    spec.role, spec.job_id, spec.num_hosts = pb.ROLE_GATEWAY, "inline-outside", 1
    spec.accelerator = "tpu-v5litepod-4"
    spec.ClearField("payload")                 # announced, not inside
    error = _run_inline(agents, spec)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inside its JobSpec" in error.details()


def test_a_job_id_with_a_trailing_newline_is_refused(servicer_factory):
    agents = servicer_factory(1, peers=False)
    channel = Credentials(token=agents.token).channel(agents.addresses[0])
    stub = pb_grpc.AgentStub(channel)
    metadata = ((("x-remote-tpu-token", agents.token)),)
    for bad in ("job\n", "job\r\n", "\njob"):
        with pytest.raises(grpc.RpcError) as info:
            stub.Status(pb.JobRef(job_id=bad), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    from remote_tpu._core.versions import versions_pb
    spec = pb.JobSpec(client_versions=versions_pb(), job_id="job\n", accelerator="tpu-v5litepod-4",
                      num_hosts=1, role=pb.ROLE_GATEWAY, payload_size=0,
                      payload_digest=b"\0" * 16, stream=pb.STREAM_MODE_LEADER)
    with pytest.raises(grpc.RpcError) as info:
        stub.Submit(iter([pb.RunRequest(spec=spec)]), metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not valid" in info.value.details()
    channel.close()
