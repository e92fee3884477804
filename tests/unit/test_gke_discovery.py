"""An agent started with GKE's variables finds the place JAX's own cluster
code gives each process: the installed jax's ``GkeTpuCluster``
(``jax/_src/clusters/cloud_tpu_cluster.py``) is called with the same
environment, for each generation GKE offers as it sets the variables: v5p and
v6e (one process per VM, ``TPU_WORKER_HOSTNAMES``) and TPU7x (two per VM,
``TPU_PROCESS_ADDRESSES`` too, which jax reads first).

Then each worker's environment, as the agent builds it, is given to jax's code
again: inside the worker jax agrees with the ``JAX_PROCESS_ID`` and
``JAX_COORDINATOR_ADDRESS`` the agent set. The coordinator's port is the
agent's own (it picks a free one per job and tells every process); jax's is a
fixed 8482: the host is what both must agree on."""

from __future__ import annotations

import pytest

from gke_env import gke_env, jax_gke_cluster, jax_sees
from metadata_server import MetadataStandIn
from remote_tpu._core.addresses import host_of, join_host_port
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.topology import Topology
from remote_tpu_agent.wire.discovery import Slice, discover
from remote_tpu_agent.worker.environment import child_environment, worker_env

pytestmark = pytest.mark.timeout(60)

jax_gke_cluster()          # skips without jax

AGENT_PORT = 8475
COORDINATOR_PORT = 4321        # the port a gateway picked for this job's coordinator


@pytest.fixture(scope="module")
def metadata():
    """jax asks the metadata server for MEGASCALE_* that the environment lacks
    (``tpu-env``): a stand-in whose tpu-env names none, as a one-slice VM's."""
    server = MetadataStandIn({"tpu-env": ""})
    yield server.address
    server.close()


def agent_worker_env(found: Slice, env: dict[str, str], k: int) -> dict[str, str]:
    """Process ``k`` of this agent's host, as the agent starts it: a job whose
    gateway is worker 0 (the host the client reaches) and whose hosts are the
    agents discovery found, in order."""
    topology = Topology.parse(found.accelerator)
    spec = pb.JobSpec(job_id="job-1", accelerator=topology.name, num_hosts=len(found.peers),
                      processes_per_host=found.processes_per_host, hosts=list(found.peers),
                      payload_digest=bytes(16))
    coordinator = join_host_port(host_of(found.peers[0]), COORDINATOR_PORT)
    return worker_env(child_environment(env), spec=spec,
                      process_id=found.worker_id * found.processes_per_host + k,
                      coordinator=coordinator, simulate_devices=0)


@pytest.mark.parametrize("accelerator, per_host", [
    ("v5p-32", 1),          # 4 VMs of 4 chips (https://cloud.google.com/tpu/docs/v5p)
    ("v6e-16", 1),          # 4 VMs of 4 chips (https://cloud.google.com/tpu/docs/v6e)
    ("tpu7x-32", 2),        # 4 VMs of 4 chips, 2 processes each (/tpu/docs/tpu7x)
])
def test_agents_on_gke_agree_with_jaxs_cluster_code(accelerator, per_host, metadata,
                                                    monkeypatch):
    topology = Topology.parse(accelerator)
    assert topology.gke_processes_per_host == per_host
    hosts = [f"10.8.0.{i + 10}" for i in range(topology.hosts)]
    for host in range(topology.hosts):
        # One agent per VM, in a pod GKE gave the variables of the VM's first
        # process; it runs every process of its VM.
        agent_env = {**gke_env(accelerator, hosts, per_host, host * per_host),
                     "PATH": "/usr/bin"}
        found = discover(port=AGENT_PORT, env=agent_env, use_metadata=False)
        assert found.source == "environment" and found.worker_id == host
        assert found.peers == tuple(f"{h}:{AGENT_PORT}" for h in hosts)
        assert found.processes_per_host == per_host
        assert found.processes_disagreement(per_host) == ""
        for k in range(per_host):
            index = host * per_host + k
            jax_id, jax_count, jax_host = jax_sees(gke_env(accelerator, hosts, per_host, index),
                                                   metadata, monkeypatch)
            assert jax_id == index and jax_host == hosts[0]
            ours = agent_worker_env(found, agent_env, k)
            assert int(ours["JAX_PROCESS_ID"]) == jax_id
            assert int(ours["JAX_NUM_PROCESSES"]) == jax_count
            assert host_of(ours["JAX_COORDINATOR_ADDRESS"]) == jax_host
            # Inside the worker, jax's own code reads the same place from what
            # the agent gave it (its TPU_* variables among them).
            inside = jax_sees({n: v for n, v in ours.items() if n.startswith("TPU_")},
                              metadata, monkeypatch)
            assert inside == (jax_id, jax_count, jax_host)


def test_a_job_with_other_processes_per_host_than_gke_lists_is_refused():
    hosts = ["10.8.0.10", "10.8.0.11", "10.8.0.12", "10.8.0.13"]
    found = discover(port=AGENT_PORT, env=gke_env("tpu7x-32", hosts, 2, 3),
                     use_metadata=False)
    assert (found.worker_id, found.processes_per_host) == (1, 2)
    assert "use processes_per_host=2" in found.processes_disagreement(1)
    # One process per VM listed (v5p, v6e): a job may run several of its own.
    found = discover(port=AGENT_PORT, env=gke_env("v5p-32", hosts, 1, 3), use_metadata=False)
    assert found.processes_disagreement(2) == ""


@pytest.mark.parametrize("addresses, expected", [
    ("10.0.0.1:8476,10.0.0.2:8476,10.0.0.1:8477,10.0.0.2:8477", "not grouped host by host"),
    ("10.0.0.1:8476,10.0.0.1:8477,10.0.0.2:8476", "not grouped host by host"),
    (",", "lists no processes"),
])
def test_process_addresses_the_agent_cannot_number_are_clear_errors(addresses, expected):
    env = {"TPU_WORKER_ID": "0", "TPU_PROCESS_ADDRESSES": addresses}
    with pytest.raises(ConfigurationError, match=expected):
        discover(port=AGENT_PORT, env=env, use_metadata=False)


def test_hostnames_that_contradict_the_process_addresses_are_a_clear_error():
    env = gke_env("tpu7x-16", ["10.0.0.1", "10.0.0.2"], 2, 0)
    env["TPU_WORKER_HOSTNAMES"] = "10.0.0.2,10.0.0.1"
    with pytest.raises(ConfigurationError, match="JAX reads TPU_PROCESS_ADDRESSES"):
        discover(port=AGENT_PORT, env=env, use_metadata=False)


def test_a_worker_id_beyond_the_processes_is_a_clear_error():
    env = gke_env("tpu7x-16", ["10.0.0.1", "10.0.0.2"], 2, 4)
    with pytest.raises(ConfigurationError, match="worker 4 is not among the 4"):
        discover(port=AGENT_PORT, env=env, use_metadata=False)
