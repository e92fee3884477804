"""GKE's TPU variables, and what the installed jax's own GKE cluster code
(``GkeTpuCluster``, ``jax/_src/clusters/cloud_tpu_cluster.py``) makes of them:
the reference the agent's discovery and workers are held to."""

from __future__ import annotations

import os

import pytest

from remote_tpu._core.addresses import host_of


def gke_env(accelerator: str, hosts: list[str], per_host: int, index: int) -> dict[str, str]:
    """What GKE gives the pod of process ``index`` of a slice (TPU7x: process
    ``index % 2`` of VM ``index // 2``)."""
    env = {"TPU_WORKER_ID": str(index), "TPU_WORKER_HOSTNAMES": ",".join(hosts),
           "TPU_ACCELERATOR_TYPE": accelerator}
    if per_host > 1:
        env["TPU_PROCESS_ADDRESSES"] = ",".join(f"{h}:{8476 + k}" for h in hosts
                                                for k in range(per_host))
    return env


def jax_gke_cluster():
    """jax's GkeTpuCluster (the test is skipped without jax). Importing jax sets
    TPU_SKIP_MDS_QUERY (and more) in this process's environment, which would
    reach every later test's agents: it is put back as it was."""
    before = dict(os.environ)
    try:
        return pytest.importorskip("jax._src.clusters.cloud_tpu_cluster").GkeTpuCluster
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        os.environ.update(before)


def jax_sees(env: dict[str, str], metadata: str, monkeypatch) -> tuple[int, int, str]:
    """(process id, process count, coordinator host) by jax's own code, in an
    environment of ``env`` alone (of its TPU and MEGASCALE variables); jax asks
    the metadata server at ``metadata`` for the MEGASCALE_* ``env`` lacks."""
    cluster = jax_gke_cluster()
    with monkeypatch.context() as m:
        for name in list(os.environ):
            if name.startswith(("TPU_", "MEGASCALE_", "CLOUD_TPU_")):
                m.delenv(name)
        for name, value in {**env, "GCE_METADATA_IP": metadata}.items():
            m.setenv(name, value)
        coordinator = cluster.get_coordinator_address(timeout_secs=5,
                                                      override_coordinator_port=None)
        return cluster.get_process_id(), cluster.get_process_count(), host_of(coordinator)
