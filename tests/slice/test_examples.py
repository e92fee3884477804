"""The workload examples, run as a user runs them: each asserts its own result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _example(name: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_data_loader_assembles_every_hosts_shard_into_one_global_array():
    out = _example("data_loader.py").stdout
    assert "host 0: 64 of 128 rows here" in out
    assert "returned to the caller: {'rows': 128, 'sum': 24384.0" in out


def test_profile_traces_every_host_into_the_jobs_output_directory(tmp_path):
    proc = _example("profile.py", "--output-dir", str(tmp_path))
    assert "traces of host_0, host_1" in proc.stdout
    assert "jax.profiler trace of job train_steps-" in proc.stderr
    [job] = os.listdir(tmp_path)
    assert f"tensorboard --logdir {tmp_path}/{job}" in proc.stderr
    # The first 0.2 s only: a trace all the same, cut short.
    short = tmp_path / "short"
    proc = _example("profile.py", "--output-dir", str(short), "--seconds", "0.2")
    assert "traces of host_0, host_1" in proc.stdout


@pytest.mark.timeout(30)
def test_profile_needs_an_output_directory_and_jax():
    import remote_tpu

    with pytest.raises(remote_tpu.ConfigurationError, match="pass output_dir="):
        remote_tpu.run(accelerator="tpu-v4-16", profile=True)
    with pytest.raises(remote_tpu.ConfigurationError, match="needs init_jax=True"):
        remote_tpu.run(accelerator="tpu-v4-16", profile=5, output_dir="gs://my-bucket/p",
                       init_jax=False)
    with pytest.raises(remote_tpu.ConfigurationError, match="number of seconds"):
        remote_tpu.run(accelerator="tpu-v4-16", profile="yes", output_dir="gs://my-bucket/p")


def test_flax_and_optax_train_on_a_3d_mesh_over_every_host():
    out = _example("train_3d_mesh.py").stdout
    assert "'mesh': {'data': 2, 'fsdp': 2, 'model': 2}" in out     # its own asserts passed


def test_keras_trains_data_parallel_over_every_host():
    out = _example("keras_data_parallel.py").stdout
    assert "'backend': 'jax', 'devices': 8" in out and "'replicated': True" in out


def test_the_extraction_example_runs_as_the_readme_says_with_a_local_default():
    """`python examples/extract_to_gcs.py`, no flags: every host's activations
    come back to a local directory it names (before: exit 2, "--output-dir is
    required")."""
    out = _example("extract_to_gcs.py", "--examples", "10").stdout
    assert "returned: {'hosts': 2, 'rows_on_host_0': 5}" in out
    paths = [line for line in out.splitlines() if line.endswith("activations.npy")]
    assert len(paths) == 2 and all(os.path.isfile(p) for p in paths), out
