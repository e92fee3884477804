"""Multislice without agents: what JAX's own cluster code derives from the
variables our workers get, a queued resource's metadata read and checked,
num_slices= and hosts= checked when applied, the DCN probe, and a failure
named by its slice from the job's end alone. Slices on real agents:
tests/slice/test_multislice.py."""

from __future__ import annotations

import os

import pytest

import remote_tpu
from metadata_server import multislice_env, tpu_vm
from remote_tpu._core.exceptions import ConfigurationError, JobFailedError
from remote_tpu._core.multislice import disagreement, from_tpu_env, parse_tpu_env
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.topology import Topology
from remote_tpu._slices import num_slices_of, parse_slices
from remote_tpu_agent.wire.discovery import MetadataServer, discover
from remote_tpu_agent.worker.environment import worker_env


@pytest.mark.parametrize("slices, accelerator", [
    (2, "tpu-v4-8"), (2, "tpu-v4-16"), (3, "tpu-v4-32"), (4, "tpu-v5litepod-8")])
def test_what_jax_derives_from_our_variables_is_what_we_pass(monkeypatch, slices, accelerator):
    """JAX's own Cloud TPU cluster code, on each host's variables and a
    metadata stand-in of its slice, derives the process id, count and
    coordinator host our workers pass to jax.distributed.initialize."""
    from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster

    per_slice = Topology.parse(accelerator).hosts
    ips = [[f"10.{s}.0.{w + 2}" for w in range(per_slice)] for s in range(slices)]
    coordinator = f"{ips[0][0]}:43211"
    spec = pb.JobSpec(job_id="j", accelerator=accelerator, num_hosts=per_slice * slices,
                      num_slices=slices, hosts=[f"{ip}:8475" for row in ips for ip in row])
    for s in range(slices):
        for w in range(per_slice):
            process = s * per_slice + w
            env = worker_env({}, spec=spec, process_id=process, coordinator=coordinator,
                             simulate_devices=0)
            server = tpu_vm(w, ips[s], accelerator.removeprefix("tpu-"))
            try:
                for name in list(os.environ):
                    if name.startswith(("MEGASCALE_", "TPU_")):
                        monkeypatch.delenv(name)
                for name, value in env.items():
                    monkeypatch.setenv(name, value)
                monkeypatch.setenv("GCE_METADATA_IP", server.address)
                assert GceTpuCluster.get_process_id() == int(env["JAX_PROCESS_ID"]) == process
                assert GceTpuCluster.get_process_count() == int(env["JAX_NUM_PROCESSES"])
                derived = GceTpuCluster.get_coordinator_address(5, None)
                assert derived.split(":")[0] == env["JAX_COORDINATOR_ADDRESS"].split(":")[0]
            finally:
                server.close()


def test_a_multislice_queued_resource_metadata_is_read_and_checked():
    server = tpu_vm(0, ["10.1.0.2", "10.1.0.3"], "v4-16", multislice_env(1, "10.0.0.2"))
    try:
        found = discover(port=8475, env={}, metadata=MetadataServer(server.address))
    finally:
        server.close()
    assert found.megascale == (2, 1, "10.0.0.2")
    assert from_tpu_env(parse_tpu_env("ACCELERATOR_TYPE: 'v4-16'\n")) is None
    assert from_tpu_env(parse_tpu_env(multislice_env(0, "10.0.0.2", num=1))) is None
    assert disagreement(found.megascale, num_slices=2, slice_id=1,
                        coordinator_host="10.0.0.2") == ""
    assert "MEGASCALE_NUM_SLICES=2), but the job asks for num_slices=3" in disagreement(
        found.megascale, num_slices=3, slice_id=1, coordinator_host="10.0.0.2")
    assert "slice 1 of its multislice" in disagreement(
        found.megascale, num_slices=2, slice_id=0, coordinator_host="10.0.0.2")
    assert "names 10.0.0.2 as the multislice coordinator" in disagreement(
        found.megascale, num_slices=2, slice_id=1, coordinator_host="10.9.9.9")


def test_num_slices_and_hosts_are_checked_when_applied(monkeypatch):
    v4 = Topology.parse("tpu-v4-16")
    monkeypatch.delenv("REMOTE_TPU_NUM_SLICES", raising=False)
    assert num_slices_of(None) == 1
    monkeypatch.setenv("REMOTE_TPU_NUM_SLICES", "3")
    assert num_slices_of(None) == 3
    for bad in (0, 65, True, 2.0, "2"):
        with pytest.raises(ConfigurationError, match="num_slices= must be a whole number"):
            num_slices_of(bad)
    monkeypatch.setenv("REMOTE_TPU_NUM_SLICES", "two")
    with pytest.raises(ConfigurationError, match="REMOTE_TPU_NUM_SLICES='two'"):
        num_slices_of(None)

    hosts, slices = parse_slices("tpu://pool?zone=us-east5-a", 3, v4, {})
    assert [s.entries[0] for s in slices] == [
        f"tpu://pool-{i}?zone=us-east5-a" for i in range(3)]
    assert hosts == slices[0]
    _, slices = parse_slices(["10.0.0.2", ["10.1.0.2", "10.1.0.3"]], 2, v4, {})
    assert slices[1].entries == ("10.1.0.2:8475", "10.1.0.3:8475")
    assert parse_slices("local", 2, v4, {})[0].local

    with pytest.raises(ConfigurationError, match="needs hosts= to name 2 slices"):
        parse_slices(["10.0.0.2"], 2, v4, {})
    with pytest.raises(ConfigurationError, match="needs hosts= to name 2 slices"):
        parse_slices("10.0.0.2", 2, v4, {})
    with pytest.raises(ConfigurationError, match="names a host in two slices"):
        parse_slices(["10.0.0.2", "10.0.0.2:8475"], 2, v4, {})
    with pytest.raises(ConfigurationError, match="hosts\\[1\\] \\(slice 1\\)"):
        parse_slices(["10.0.0.2", ["10.1.0.2", "10.1.0.3", "10.1.0.4"]], 2, v4, {})
    with pytest.raises(ConfigurationError, match="give it alone"):
        parse_slices(["local", "local"], 2, v4, {})
    with pytest.raises(ConfigurationError, match="env= sets MEGASCALE_SLICE_ID"):
        parse_slices("local", 2, v4, {"MEGASCALE_SLICE_ID": "1"})
    for port in ("notaport", "0", "99999"):
        with pytest.raises(ConfigurationError, match=f"MEGASCALE_PORT='{port}' is not a port"):
            parse_slices("local", 2, v4, {"MEGASCALE_PORT": port})
    with pytest.raises(ConfigurationError, match="processes_per_host=2 with num_slices=2"):
        remote_tpu.run(accelerator="tpu-v4-16", num_slices=2, processes_per_host=2)
    monkeypatch.setenv("REMOTE_TPU_HOSTS", "10.0.0.2;10.1.0.2,10.1.0.3")
    _, slices = parse_slices(None, 2, v4, {})
    assert [s.entries for s in slices] == [("10.0.0.2:8475",),
                                           ("10.1.0.2:8475", "10.1.0.3:8475")]
    # Every other command (jobs, attach, doctor of one slice) reaches slice 0's gateway.
    from remote_tpu._core.addresses import parse_hosts
    assert parse_hosts(None).entries == ("10.0.0.2:8475",)
    with pytest.raises(ConfigurationError, match="num_slices= must be a whole number"):
        remote_tpu.run(accelerator="tpu-v4-16", num_slices=0)


def test_a_dcn_probe_tells_a_reachable_host_from_an_unreachable_one(monkeypatch):
    import socket

    from conftest import free_port
    from remote_tpu_agent.server import slice_queries as _slice_queries
    from remote_tpu_agent.server.slice_queries import _probe

    assert _probe(f"127.0.0.1:{free_port()}").error == ""     # refused: the host answered
    assert _probe("no-port").error == "not an address host:port"
    # A listener whose queue is full drops new connections unanswered, as a
    # firewall between slices would: the probe gives up after its time.
    monkeypatch.setattr(_slice_queries, "PROBE_SECONDS", 0.5)
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = f"127.0.0.1:{full.getsockname()[1]}"
        waiting = []
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(full.getsockname())
            waiting.append(s)
        try:
            dropped = _probe(address)
        finally:
            for s in waiting:
                s.close()
    assert dropped.error.startswith("no answer within 0.5 s"), dropped


def test_a_failure_names_its_slice_and_process_from_the_end_alone():
    from remote_tpu._outcome import raise_for_end

    hosts = [pb.HostReport(host=i, state=pb.HOST_STATE_CANCELLED) for i in range(8)]
    hosts[5] = pb.HostReport(host=5, state=pb.HOST_STATE_DIED, detail="killed by SIGKILL")
    end = pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=5, hosts=hosts, num_slices=2)
    with pytest.raises(JobFailedError) as info:
        raise_for_end(end, accelerator="tpu-v4-16", job_id="j", label="process")
    text = str(info.value)
    assert text.startswith("process 5 (slice 1 process 1) of 8 (2 slices of tpu-v4-16, job j)")
    assert "  process 3 (slice 0 process 3): cancelled" in text
