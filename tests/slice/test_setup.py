"""remote-tpu setup (and up, which runs it) over real SSH: TPU VMs as network
namespaces with a real sshd each, a home of their own, no internet: they install
jax and friends from a package index on this machine (wheels of this test
environment's own packages, tests/wheelhouse.py), and the client's own
remote-tpu from the wheel setup copies. Skipped where such VMs cannot be made
(not root, no sshd: tests/ssh_vms.py says why)."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys

import pytest

import remote_tpu
from conftest import ROOT, wait_until
from package_index import PackageIndex
from ssh_vms import SshVms
from tpu_api import CloudTpuStandIn
from wheelhouse import dependency_wheels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AGENT_ARGS = "--simulate-devices 2 --log-level WARNING"


@pytest.fixture(scope="module")
def vms(tmp_path_factory):
    reason = SshVms.available()
    if reason:
        pytest.skip(reason)
    wheels = str(tmp_path_factory.mktemp("wheelhouse"))
    dependency_wheels(wheels)
    try:
        made = SshVms(4, accelerator="v4-32")
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot make network namespaces with sshd here: {exc}")
    made.index = PackageIndex(wheels, host=made.host_ip)
    made.token_file = str(tmp_path_factory.mktemp("token") / "token")
    from remote_tpu._core.auth import new_token, write_token_file
    write_token_file(made.token_file, new_token())
    made.token = open(made.token_file).read().strip()
    yield made
    made.index.close()
    made.close()


def _cli(vms: SshVms, *args: str, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    """``remote-tpu ARGS``; for setup and up, with what reaches these VMs."""
    setup = [*vms.ssh_args, "--pip-index", vms.index.url, "--agent-args", AGENT_ARGS,
             "--token-file", vms.token_file] if args[0] in ("setup", "up") else []
    return subprocess.run(
        [sys.executable, "-m", "remote_tpu", *args, *setup],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, **env})


def _steps(out: str, host: int) -> list[str]:
    return re.findall(rf"^host {host} \([^)]*\): (.*)$", out, re.M)


def test_setup_makes_every_vm_serve_a_call_names_a_failing_one_and_runs_again_as_a_no_op(vms):
    hosts = [f"root@{ip}" for ip in vms.ips]
    # VM 3 cannot reach the package index: it alone fails, named with its last lines.
    vms.index.refuse = {vms.ips[3]}
    first = _cli(vms, "setup", *hosts)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "1 of 4 host(s) failed" in first.stderr
    assert f"host 3 ({vms.ips[3]}): pip could not install remote-tpu and jax" in first.stderr
    assert "its last lines:" in first.stderr
    assert "No matching distribution found for jax" in first.stderr
    assert "Hosts 0, 1, 2 are ready, their agents running" in first.stderr
    for i in range(3):
        steps = _steps(first.stdout, i)
        assert steps[0].startswith("making the agent's environment with "), first.stdout
        assert steps[1].startswith("installing remote-tpu and jax ")
        assert steps[-1] == "ready: started"

    # Fixed: running it again installs VM 3 only; the others are left as they are.
    vms.index.refuse = set()
    second = _cli(vms, "setup", *hosts)
    assert second.returncode == 0, second.stdout + second.stderr
    assert _steps(second.stdout, 3)[-1] == "ready: started"
    assert any(s.startswith("installing remote-tpu") for s in _steps(second.stdout, 3))
    for i in range(3):
        assert _steps(second.stdout, i) == [
            "remote-tpu, jax and jaxlib already as the client's",
            _steps(second.stdout, i)[1], "ready: unchanged"], second.stdout
    # The doctor's table, from this machine: every host reachable, one version.
    table = second.stdout[second.stdout.index("HOST  ADDRESS"):]
    assert len(re.findall(r"^\d\s+10\.254\.\d+\.\d+:8475\s+yes\s+0\.1\.0", table, re.M)) == 4
    assert f"ready: hosts='{vms.ips[0]}:8475'" in second.stdout
    assert re.search(r"^4 host\(s\) ready in \d+\.\d s$", second.stdout, re.M)

    @remote_tpu.run(accelerator="tpu-v4-32", hosts=f"{vms.ips[0]}:8475", token=vms.token)
    def everywhere():
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils
        ones = multihost_utils.process_allgather(jnp.ones(jax.local_device_count()))
        return float(ones.sum()), jax.process_index(), os.environ["JAX_COORDINATOR_ADDRESS"]

    with pytest.warns(UserWarning, match="no TLS"):
        total, index, coordinator = everywhere()
    assert (total, index) == (8.0, 0) and coordinator.startswith(f"{vms.ips[0]}:")

    # The token reached each VM over the SSH channel only: a 0600 file there,
    # on no command line of any process in the VMs.
    for i in range(4):
        path = os.path.join(vms.home(i), ".config", "remote_tpu", "token")
        assert open(path).read().strip() == vms.token
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for ns in vms.namespaces:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert vms.token.encode() not in f.read()
            except FileNotFoundError:
                pass

    third = _cli(vms, "setup", *hosts)
    assert third.returncode == 0, third.stdout + third.stderr
    assert [_steps(third.stdout, i)[-1] for i in range(4)] == ["ready: unchanged"] * 4

    # A run cut short after the install, before its agent listened, leaves no
    # record of a started agent: the next run starts it, and only it.
    os.remove(os.path.join(vms.home(2), ".local", "share", "remote-tpu", "agent.state"))
    fourth = _cli(vms, "setup", *hosts)
    assert fourth.returncode == 0, fourth.stdout + fourth.stderr
    assert [_steps(fourth.stdout, i)[-1] for i in range(4)] == \
        ["ready: unchanged", "ready: unchanged", "ready: started", "ready: unchanged"]
    assert any(s.startswith("stopping the old agent (pid ") for s in _steps(fourth.stdout, 2))


def test_up_creates_the_slice_sets_it_up_a_call_runs_and_down_deletes_it(vms, monkeypatch):
    api = CloudTpuStandIn(vms.ips, waits=1)
    try:
        env = {"REMOTE_TPU_TPU_API": api.url, "REMOTE_TPU_UP_POLL_SECONDS": "0.05"}
        for standin in vms.metadata_servers:
            standin.service_account("vm-token", ["https://www.googleapis.com/auth/cloud-platform"])
        up = _cli(vms, "up", "vms", "--accelerator", "tpu-v4-32", "--zone", "z-1",
                  "--project", "p", "--user", "root", "--idle-delete", "30", "--spot", **env)
        assert up.returncode == 0, up.stdout + up.stderr
        # --idle-delete: the VMs get the scope to delete their slice, worker 0's
        # agent the flags (its doctor row says so); nothing is idle for 30 min here.
        node = [r for r in api.requests if r[0] == "POST"][0][2]["tpu"]["nodeSpec"][0]["node"]
        assert node["serviceAccount"] == {"scope": [
            "https://www.googleapis.com/auth/cloud-platform"]}
        rows = up.stdout[up.stdout.index("HOST  ADDRESS"):].splitlines()
        assert "idle-delete after 30 min: on" in rows[1], up.stdout
        assert "vms: ACTIVE" in up.stdout and "ACTIVE: vms. Setting up the agents" in up.stdout
        # Named by tpu://, each agent finds its place in its VM's metadata (after
        # the test above: new flags, so each agent is started again).
        for i in range(4):
            assert _steps(up.stdout, i)[-1] == "ready: started", up.stdout
        assert "v4-32" in up.stdout[up.stdout.index("HOST  ADDRESS"):]     # from metadata
        monkeypatch.setenv("REMOTE_TPU_TPU_API", api.url)
        ref = "tpu://vms?zone=z-1&project=p"
        assert f"or hosts='{ref}'" in up.stdout

        @remote_tpu.run(accelerator="tpu-v4-32", hosts=ref, token=vms.token)
        def where():
            import jax
            return jax.process_count(), jax.process_index()

        assert where() == (4, 0)       # (the "no TLS" warning came once, above)

        # A spot VM taken back during a job: its metadata says preempted, its
        # worker dies; the job is retried under its preemption budget.
        marker = os.path.join(vms.base, "worker-pid")

        @remote_tpu.run(accelerator="tpu-v4-32", hosts=ref, token=vms.token, init_jax=False,
                        retries=remote_tpu.Retries(preemptions=1, failures=0, backoff=0))
        def step():
            import time
            attempt = int(os.environ["REMOTE_TPU_ATTEMPT"])
            if attempt == 0 and os.environ["REMOTE_TPU_HOST_INDEX"] == "1":
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60)
            return attempt

        handle = step.submit()
        assert wait_until(lambda: os.path.exists(marker) and open(marker).read(), 60)
        vms.metadata_servers[1].instance["preempted"] = "TRUE"
        os.kill(int(open(marker).read()), signal.SIGKILL)
        assert handle.result(timeout=120) == 1
        [attempt] = handle.status().attempts
        assert (attempt.kind, attempt.state) == ("preemption", "PREEMPTED"), attempt
        vms.metadata_servers[1].instance["preempted"] = "FALSE"
        down = _cli(vms, "down", "vms", "--zone", "z-1", "--project", "p", **env)
        assert down.returncode == 0 and api.resources == {} and api.nodes == {}, down.stderr
    finally:
        api.close()
