"""num_slices=N: one job on several slices, as JAX and libtpu expect it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import remote_tpu
from conftest import ROOT
from metadata_server import MetadataSlice, TpuApiStandIn, tpu_node, tpu_vm
from remote_tpu._core.exceptions import ConfigurationError, JobFailedError
from remote_tpu._core.multislice import disagreement, from_tpu_env, parse_tpu_env
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.topology import Topology
from remote_tpu._slices import num_slices_of, parse_slices
from remote_tpu_agent.wire.discovery import MetadataServer, discover
from remote_tpu_agent.worker.environment import worker_env

pytestmark = pytest.mark.timeout(180)

_VARS = ("MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS",
         "MEGASCALE_PORT", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "REMOTE_TPU_SLICE_ID")


def _report():
    """Each process: its variables, and a collective over every process."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    print(f"slice {os.environ['MEGASCALE_SLICE_ID']} says hello", flush=True)
    mine = {k: os.environ.get(k) for k in _VARS}
    table = multihost_utils.process_allgather(
        jnp.array([int(mine["JAX_PROCESS_ID"]), int(mine["MEGASCALE_SLICE_ID"])]))
    total = multihost_utils.process_allgather(jnp.ones(jax.local_device_count())).sum()
    return mine, table.tolist(), float(total), jax.process_index(), jax.process_count()


def test_two_local_slices_run_as_one_job_with_the_variables_jax_expects(capsys):
    step = remote_tpu.run(accelerator="tpu-v4-16", hosts="local", num_slices=2,
                          stream="all")(_report)
    mine, table, total, index, count = step()
    # Process 0 is worker 0 of slice 0; ids go slice by slice (slice x 2 + worker).
    assert (index, count) == (0, 4)
    assert table == [[0, 0], [1, 0], [2, 1], [3, 1]]
    assert total == 16.0                  # 4 processes x 4 simulated chips, one collective
    assert mine == {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "0",
                    "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1", "MEGASCALE_PORT": "8081",
                    "JAX_PROCESS_ID": "0", "JAX_NUM_PROCESSES": "4",
                    "REMOTE_TPU_SLICE_ID": "0"}
    out = capsys.readouterr().out
    for s, i in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert f"[slice {s} host {i}] slice {s} says hello\n" in out


def test_a_failure_on_slice_1_is_the_root_cause_and_stops_slice_0_at_once():
    @remote_tpu.run(accelerator="tpu-v4-16", hosts="local", num_slices=2,
                    env={"MEGASCALE_PORT": "9191"})
    def step():
        import time
        if os.environ["REMOTE_TPU_HOST_INDEX"] == "3":
            assert os.environ["MEGASCALE_PORT"] == "9191"
            time.sleep(1)
            raise ValueError("bad shard on slice 1")
        time.sleep(120)

    with pytest.raises(ValueError, match="bad shard on slice 1") as info:
        step()
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on host 3 (slice 1 host 1) of 4 (2 slices of tpu-v4-16" in note
    end = info.value.remote_tpu_end
    assert end.root_cause_host == 3
    failed_at = end.hosts[3].finished_at
    for report in end.hosts[:3]:
        assert report.state == pb.HOST_STATE_CANCELLED, report
        # Stopped by the gateway within 2 s of the failure, not at JAX's timeout.
        assert report.finished_at - failed_at < 2.0, (report, failed_at)


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


def _multislice_env(slice_id: int, coordinator: str, num: int = 2) -> str:
    return (f"MEGASCALE_NUM_SLICES: '{num}'\nMEGASCALE_SLICE_ID: '{slice_id}'\n"
            f"MEGASCALE_COORDINATOR_ADDRESS: '{coordinator}:8080'\n")


def test_a_multislice_queued_resource_metadata_is_read_and_checked():
    server = tpu_vm(0, ["10.1.0.2", "10.1.0.3"], "v4-16", _multislice_env(1, "10.0.0.2"))
    try:
        found = discover(port=8475, env={}, metadata=MetadataServer(server.address))
    finally:
        server.close()
    assert found.megascale == (2, 1, "10.0.0.2")
    assert from_tpu_env(parse_tpu_env("ACCELERATOR_TYPE: 'v4-16'\n")) is None
    assert from_tpu_env(parse_tpu_env(_multislice_env(0, "10.0.0.2", num=1))) is None
    assert disagreement(found.megascale, num_slices=2, slice_id=1,
                        coordinator_host="10.0.0.2") == ""
    assert "MEGASCALE_NUM_SLICES=2), but the job asks for num_slices=3" in disagreement(
        found.megascale, num_slices=3, slice_id=1, coordinator_host="10.0.0.2")
    assert "slice 1 of its multislice" in disagreement(
        found.megascale, num_slices=2, slice_id=0, coordinator_host="10.0.0.2")
    assert "names 10.0.0.2 as the multislice coordinator" in disagreement(
        found.megascale, num_slices=2, slice_id=1, coordinator_host="10.9.9.9")


@pytest.mark.slow
def test_slices_from_their_metadata_run_one_job_and_a_wrong_order_is_refused(monkeypatch):
    """Two slices of two TPU VMs each, as a multislice queued resource makes
    them: every host knows its slice only from its metadata stand-in. The
    client names one host of each slice; JAX's own cluster code, run in each
    worker against its host's metadata, agrees with what the worker was given."""
    first = MetadataSlice("v4-16", 2, ["--pass-env", "GCE_METADATA_IP"],
                          tpu_env=_multislice_env(0, "127.0.0.2"))
    second = MetadataSlice("v4-16", 2, ["--pass-env", "GCE_METADATA_IP"], first_ip=10,
                           tpu_env=_multislice_env(1, "127.0.0.2"), token=first.token,
                           port=first.port)
    # The two slices as one multislice queued resource's nodes, pool-0 and pool-1.
    api = TpuApiStandIn({f"projects/p/locations/z/nodes/pool-{s}": tpu_node(vm.ips, "v4-16")
                         for s, vm in enumerate((first, second))})
    monkeypatch.setenv("REMOTE_TPU_TPU_API", api.url)
    try:
        def derived():
            from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster
            import jax
            import jax.numpy as jnp
            from jax.experimental import multihost_utils

            os.environ.pop("TPU_SKIP_MDS_QUERY", None)
            ours = (jax.process_index(), jax.process_count(),
                    os.environ["JAX_COORDINATOR_ADDRESS"].split(":")[0])
            theirs = (GceTpuCluster.get_process_id(), GceTpuCluster.get_process_count(),
                      GceTpuCluster.get_coordinator_address(5, None).split(":")[0])
            agree = multihost_utils.process_allgather(jnp.array(int(ours == theirs)))
            return ours, theirs, agree.tolist()

        run = remote_tpu.run(accelerator="tpu-v4-16", num_slices=2, token=first.token,
                             hosts=[first.addresses[1], second.addresses[1]])(derived)
        ours, theirs, agree = run()
        assert ours == theirs == (0, 4, "127.0.0.2")
        assert agree == [1, 1, 1, 1]
        pool = remote_tpu.run(accelerator="tpu-v4-16", num_slices=2, token=first.token,
                              hosts=f"tpu://pool?zone=z&project=p&port={first.port}")
        assert pool(derived)() == (ours, theirs, agree)

        # Slices named by one agent each: the client asks them, and refuses at once.
        backwards = remote_tpu.run(accelerator="tpu-v4-16", num_slices=2, token=first.token,
                                   hosts=[second.addresses[0], first.addresses[0]])(len)
        with pytest.raises(ConfigurationError, match=re.escape(
                "is slice 1 of a multislice of 2 by its own TPU environment, but the job "
                "lists it as slice 0 of 2")):
            backwards([])
        # Slices named by every host: each agent checks its own metadata.
        backwards = remote_tpu.run(accelerator="tpu-v4-16", num_slices=2, token=first.token,
                                   hosts=[second.addresses, first.addresses])(len)
        with pytest.raises(JobFailedError) as info:
            backwards([])
        assert "this slice is slice 1 of its multislice" in str(info.value)
        assert "list the slices in hosts= in the order of their slice ids" in str(info.value)
        wrong = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor",
                                second.addresses[0], first.addresses[0]],
                               env={**os.environ, "REMOTE_TPU_TOKEN": first.token},
                               capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 1 and "slice 0 host 0 is slice 1 of a multislice of 2" \
            in wrong.stdout, wrong.stdout + wrong.stderr

        # The doctor checks both slices, and the DCN between them.
        env = {**os.environ, "REMOTE_TPU_TOKEN": first.token}
        doctor = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor",
                                 first.addresses[0], second.addresses[1]], env=env,
                                capture_output=True, text=True, timeout=60)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        for row in ("0/0   127.0.0.2", "0/1   127.0.0.3", "1/0   127.0.0.10",
                    "1/1   127.0.0.11"):
            assert row in doctor.stdout, doctor.stdout
        assert doctor.stdout.count("DCN: reached 2 of 2 hosts of the other slices") == 4
        second.stop()
        doctor = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor",
                                 first.addresses[0], second.addresses[1]], env=env,
                                capture_output=True, text=True, timeout=60)
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        assert "- slice 1: " in doctor.stdout and "1/?" in doctor.stdout, doctor.stdout
    finally:
        api.close()
        first.stop()
        if second.procs[0].poll() is None:
            second.stop()


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


@pytest.mark.slow
def test_the_multislice_example_trains_across_two_slices():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multislice.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[slice 1 host 0] slice 1: 8 chips of 16" in proc.stdout
    assert "returned to the caller: {'first_loss'" in proc.stdout


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
