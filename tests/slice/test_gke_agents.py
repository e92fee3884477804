"""Agents started as GKE starts them: told who they are only by the variables
GKE gives a TPU pod (TPU7x's two processes per VM among them), on 127.0.0.2,
127.0.0.3 (one port, like pods), their JAX on CPU. The processes a job runs
get the ids, count and coordinator host that the installed jax's own
``GkeTpuCluster`` gives GKE's processes; the decisions themselves are checked
process by process in tests/unit/test_gke_discovery.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import remote_tpu
from gke_env import gke_env, jax_gke_cluster, jax_sees
from metadata_server import AgentsOnAddresses, MetadataStandIn
from remote_tpu._core.addresses import host_of

pytestmark = pytest.mark.timeout(180)

jax_gke_cluster()          # skips without jax


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("TPU_", "MEGASCALE_", "GCE_METADATA"))}


class GkePods(AgentsOnAddresses):
    """One agent per VM, each started with the variables of its VM's first
    process, as a pod of `remote-tpu gke manifest` is."""

    def __init__(self, accelerator: str, vms: int, per_host: int) -> None:
        ips = [f"127.0.0.{2 + i}" for i in range(vms)]
        super().__init__(ips, [gke_env(accelerator, ips, per_host, i * per_host)
                               for i in range(vms)], prefix="gke-pods-", base=_base_env())


def test_print_slice_from_tpu7x_variables():
    ips = ["10.8.0.10", "10.8.0.11"]
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--print-slice"],
                          capture_output=True, text=True, timeout=30,
                          env={**_base_env(), **gke_env("tpu7x-16", ips, 2, 3)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"worker_id": 1, "peers": ["10.8.0.10:8475",
                                                                 "10.8.0.11:8475"],
                                       "accelerator": "tpu7x-16", "source": "environment",
                                       "megascale": None, "processes_per_host": 2}


@pytest.mark.slow
def test_a_tpu7x_job_on_gke_agents_numbers_its_processes_as_jax_does(monkeypatch):
    pods = GkePods("tpu7x-16", 2, 2)
    metadata = MetadataStandIn({"tpu-env": ""})     # jax asks it for MEGASCALE_*
    try:
        # processes_per_host: TPU7x's own default, two per VM.
        @remote_tpu.run(accelerator="tpu7x-16", hosts=f"{pods.ips[0]}:{pods.port}",
                        token=pods.token, all_results=True)
        def where():
            import jax
            return (int(os.environ["REMOTE_TPU_HOST_INDEX"]), jax.process_index(),
                    jax.process_count(), os.environ["JAX_COORDINATOR_ADDRESS"])

        ran = where()
        expected = [jax_sees(gke_env("tpu7x-16", pods.ips, 2, i), metadata.address,
                              monkeypatch) for i in range(4)]
        assert [(pid, count, host_of(coordinator)) for _, pid, count, coordinator in ran] \
            == expected
        # Processes 2h and 2h + 1, as GKE places them, ran on VM h.
        assert [host for host, *_ in ran] == [0, 0, 1, 1]
    finally:
        metadata.close()
        pods.stop()
