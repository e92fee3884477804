"""Version skew between the hosts of a slice: a job is refused before anything
starts, naming every host's versions, and `remote-tpu doctor` shows them. One
of two real agents has another jax and jaxlib installed (as its Python finds
them: their metadata first on its path)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import remote_tpu
from conftest import ROOT, Agents, live_workers
from remote_tpu._core.versions import local_versions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def skewed(tmp_path):
    """Two agents; host 1's Python finds jax and jaxlib 0.0.1 first."""
    for name in ("jax", "jaxlib"):
        info = tmp_path / "other" / f"{name}-0.0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       "Version: 0.0.1\n\n")
    agents = Agents(2, envs=[{}, {"PYTHONPATH": str(tmp_path / "other")}])
    yield agents
    agents.stop()


def test_a_job_on_hosts_with_another_jax_is_refused_naming_every_hosts(skewed):
    ours = local_versions()["jax"]

    @remote_tpu.run(accelerator="tpu-v4-16", hosts=skewed.addresses[0], token=skewed.token,
                    retries=3)
    def f():
        return 1

    with pytest.raises(remote_tpu.JobFailedError) as info:
        f()
    text = str(info.value)
    assert "nothing was started on any host" in text, text
    assert f"jax: the agent at {skewed.addresses[1]} 0.0.1, the gateway {ours}" in text, text
    assert "the hosts run different versions" in text, text
    table = text[text.index("HOST  "):]
    assert f"host 1 ({skewed.addresses[1]})" in table and "0.0.1" in table, table
    assert "host 0 (the gateway)" in table and ours in table, table
    assert len(info.value.remote_tpu_end.hosts) == 2
    assert not live_workers()
    assert len(remote_tpu.attach(info.value.job_id, hosts=skewed.addresses[0],
                                 token=skewed.token).status().attempts) <= 1   # not retried


def test_doctor_prints_every_hosts_versions_and_the_skew(skewed):
    done = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor",
                           skewed.addresses[0]], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ,
                                            "REMOTE_TPU_TOKEN": skewed.token})
    assert done.returncode == 1, done.stdout + done.stderr
    header, *rows = done.stdout.splitlines()[:3]
    assert header.split()[:8] == ["HOST", "ADDRESS", "REACHABLE", "REMOTE_TPU", "PYTHON",
                                  "JAX", "JAXLIB", "LIBTPU"], done.stdout
    assert rows[1].split()[5:7] == ["0.0.1", "0.0.1"], done.stdout
    assert "the hosts run different versions" in done.stdout + done.stderr
    assert "jax: host 0 " in done.stdout + done.stderr
