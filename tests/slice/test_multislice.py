"""num_slices=N: one job on several slices, as JAX and libtpu expect it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import remote_tpu
from conftest import ROOT
from metadata_server import MetadataSlice, TpuApiStandIn, multislice_env, tpu_node
from remote_tpu._core.exceptions import ConfigurationError, JobFailedError
from remote_tpu._core.proto import remote_tpu_pb2 as pb

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


@pytest.mark.slow
def test_slices_from_their_metadata_run_one_job_and_a_wrong_order_is_refused(monkeypatch):
    """Two slices of two TPU VMs each, as a multislice queued resource makes
    them: every host knows its slice only from its metadata stand-in. The
    client names one host of each slice; JAX's own cluster code, run in each
    worker against its host's metadata, agrees with what the worker was given."""
    first = MetadataSlice("v4-16", 2, ["--pass-env", "GCE_METADATA_IP"],
                          tpu_env=multislice_env(0, "127.0.0.2"))
    second = MetadataSlice("v4-16", 2, ["--pass-env", "GCE_METADATA_IP"], first_ip=10,
                           tpu_env=multislice_env(1, "127.0.0.2"), token=first.token,
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


@pytest.mark.slow
def test_the_multislice_example_trains_across_two_slices():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multislice.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[slice 1 host 0] slice 1: 8 chips of 16" in proc.stdout
    assert "returned to the caller: {'first_loss'" in proc.stdout
