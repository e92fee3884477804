"""Real TPU VMs, through faithful stand-ins: the metadata server (a real HTTP
server), TPU environment variables, the libtpu lock file and device files held
by real processes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

import remote_tpu
from conftest import ROOT, hold_open, wait_until
from metadata_server import MetadataSlice, TpuApiStandIn, tpu_node, tpu_vm
from remote_tpu._core.auth import TOKEN_ENV, new_token
from remote_tpu._core.exceptions import ConfigurationError

pytestmark = pytest.mark.timeout(120)


def test_print_slice():
    server = tpu_vm(1, ["10.1.0.5", "10.1.0.6"], "v4-16")
    try:
        proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--print-slice"],
                              capture_output=True, text=True, timeout=30,
                              env={**os.environ, "GCE_METADATA_IP": server.address})
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"worker_id": 1, "peers": ["10.1.0.5:8475",
                                                                 "10.1.0.6:8475"],
                                       "accelerator": "v4-16", "source": "metadata",
                                       "megascale": None, "processes_per_host": 1}


@pytest.mark.slow
def test_agents_from_metadata_run_a_collective_with_the_client_at_worker_1():
    vm = MetadataSlice("v4-16", 2)
    try:
        @remote_tpu.run(accelerator="tpu-v4-16", hosts=vm.addresses[1], token=vm.token)
        def total():
            import jax
            import jax.numpy as jnp
            from jax.experimental import multihost_utils
            ones = multihost_utils.process_allgather(jnp.ones(jax.local_device_count()))
            return float(ones.sum()), jax.process_index(), os.environ["JAX_COORDINATOR_ADDRESS"]

        value, index, coordinator = total()
        assert (value, index) == (4.0, 0)
        assert coordinator.startswith("127.0.0.2:")       # worker 0 is the coordinator

        wrong = remote_tpu.run(accelerator="tpu-v4-32", hosts=vm.addresses[0],
                               token=vm.token)(len)
        with pytest.raises(ConfigurationError) as info:
            wrong([])
        assert ("asked for tpu-v4-32, 4 host(s); this slice (from its metadata) is "
                "tpu-v4-16, 2 host(s). Use accelerator='tpu-v4-16'" in str(info.value))
    finally:
        vm.stop()


# ---------------------------------------------------------------- TPU locks




def _lone_agent(tpu_files, *extra):
    from conftest import Agents
    lock, device = tpu_files
    # Not simulated: a simulated slice never touches TPU locks (a CPU-only
    # machine runs the worker's JAX on CPU all the same).
    return Agents(1, devices=0, peers=False,
                  extra=["--tpu-lockfile", str(lock), "--tpu-devices",
                         str(device.parent / "accel*"), *extra])


def _use_tpu(agents, device):
    @remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                    token=agents.token)
    def use(kill_self=False):
        held = open(device, "a")         # like libtpu: the device stays open while we run
        if kill_self:
            os.kill(os.getpid(), signal.SIGKILL)
        held.close()
        return "ran"
    return use


def test_stale_lock_is_removed_and_a_live_foreign_holder_blocks(tpu_files):
    lock, device = tpu_files
    agents = _lone_agent(tpu_files)
    try:
        use = _use_tpu(agents, device)
        lock.write_text("left by a process that died\n")
        assert use() == "ran"
        assert not lock.exists(), "the stale lock was left"
        holder = hold_open(str(device))
        try:
            with pytest.raises(remote_tpu.JobFailedError) as info:
                use()
            msg = str(info.value)
            assert f"pid {holder.pid}" in msg and "time.sleep(300)" in msg
            assert "--kill-tpu-holders" in msg
        finally:
            holder.kill()
            holder.wait()
        assert use() == "ran"
        with pytest.raises(remote_tpu.JobFailedError, match="killed by SIGKILL"):
            use(kill_self=True)            # the worker dies holding the TPU ...
        assert use() == "ran"              # ... and the next job starts all the same
    finally:
        agents.stop()


def test_kill_tpu_holders_frees_the_tpu(tpu_files):
    lock, device = tpu_files
    agents = _lone_agent(tpu_files, "--kill-tpu-holders")
    holder = hold_open(str(lock))
    try:
        assert _use_tpu(agents, device)() == "ran"
        assert holder.wait(5) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            holder.kill()
        agents.stop()


# ------------------------------------------------------------- deployment


def test_install_service_dry_run_prints_the_unit():
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "install-service",
                           "--dry-run", "--host", "0.0.0.0", "--tls-cert", "a.pem",
                           "--tls-key", "a.key"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "LOGNAME": "tpu-user"})   # (who runs it)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\nUser=tpu-user\n" in out
    assert "# /etc/systemd/system/remote-tpu-agent.service" in out
    assert (f"ExecStart={sys.executable} -m remote_tpu_agent --host 0.0.0.0 --tls-cert a.pem "
            "--tls-key a.key") in out
    assert "Restart=on-failure" in out and "WantedBy=multi-user.target" in out
    assert "systemctl enable --now remote-tpu-agent.service" in out
    typo = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "install-service",
                           "--dry-run", "--hots", "x"], capture_output=True, text=True,
                          timeout=30)
    assert typo.returncode == 2 and "unrecognized arguments: --hots" in typo.stderr


@pytest.mark.parametrize("sudo_user", ["alice", None])
def test_install_service_as_root_without_user_is_refused(sudo_user):
    """Under sudo the user is root: without --user the agent, and every job a
    token holder sends, would run as root. Only an explicit --user root does."""
    env = {k: v for k, v in os.environ.items() if k != "SUDO_USER"}
    env.update(LOGNAME="root", USER="root", **({"SUDO_USER": sudo_user} if sudo_user else {}))
    cmd = [sys.executable, "-m", "remote_tpu_agent", "install-service", "--dry-run",
           "--host", "0.0.0.0", "--insecure"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert refused.returncode == 2 and "User=" not in refused.stdout
    assert "without --user the agent would run as root" in refused.stderr
    assert f"--user {sudo_user or 'NAME'}" in refused.stderr and "--user root" in refused.stderr
    meant = subprocess.run(cmd + ["--user", "root"], capture_output=True, text=True, timeout=30,
                           env=env)
    assert meant.returncode == 0 and "\nUser=root\n" in meant.stdout


def _deploying_recipe() -> str:
    """The first bash block of the manual's "Install the agents" section
    (docs/deploying.md)."""
    with open(os.path.join(ROOT, "docs", "deploying.md")) as f:
        page = f.read()
    section = page.split("## Install the agents", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_deploying_recipe_copies_the_token_file_and_expands_nothing_locally():
    recipe = _deploying_recipe()
    assert "$(cat" not in recipe and "echo" not in recipe and "`" not in recipe
    assert "REMOTE_TPU_TOKEN" not in recipe and "--token" not in recipe
    assert ("gcloud compute tpus tpu-vm scp ~/.config/remote_tpu/token "
            "NAME:~/.config/remote_tpu/token --zone ZONE --worker=all") in recipe
    assert recipe.index("chmod 700 ~/.config/remote_tpu") < recipe.index("tpu-vm scp")
    assert recipe.index("tpu-vm scp") < recipe.index("chmod 600 ~/.config/remote_tpu/token")
    # Every remote command is single-quoted: nothing in it expands on the laptop, and
    # outside those quotes there is nothing to expand but the local token's path.
    remote = re.findall(r"--command '([^']*)'", recipe)
    assert len(remote) == 2 and recipe.count("--command") == 2
    local = re.sub(r"--command '[^']*'", "--command REMOTE", recipe)
    assert "$" not in local and '"' not in local
    assert ('sudo env HOME="$HOME" "$(which python3)" -m remote_tpu_agent install-service '
            '--user "$(whoami)"') in remote[1]


def test_install_service_unit_for_the_deploying_recipe():
    line = [ln for ln in _deploying_recipe().splitlines() if "install-service" in ln][0]
    flags = shlex.split(line.split("install-service", 1)[1].rstrip("'"))
    assert flags[:2] == ["--user", "$(whoami)"]
    agent_flags = flags[2:]
    assert agent_flags == ["--host", "0.0.0.0", "--insecure"]
    token = new_token()
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "install-service",
                           "--dry-run", "--user", "tpu-user", *agent_flags],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, TOKEN_ENV: token})
    assert proc.returncode == 0, proc.stderr
    unit = proc.stdout
    assert "\nUser=tpu-user\n" in unit
    exec_start = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    assert exec_start == [f"ExecStart={sys.executable} -m remote_tpu_agent --host 0.0.0.0 "
                          "--insecure"]
    assert token not in unit and "token" not in exec_start[0].lower()


def test_doctor_against_a_local_slice():
    local = subprocess.Popen([sys.executable, "-m", "remote_tpu", "local", "--accelerator",
                              "tpu-v4-16"], stdout=subprocess.PIPE, text=True)
    try:
        env = dict(os.environ)
        for _ in range(3):
            line = local.stdout.readline().strip()
            if "=" in line and line.startswith("REMOTE_TPU_"):
                key, value = line.split("=", 1)
                env[key] = value
        proc = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].split() == ["HOST", "ADDRESS", "REACHABLE", "REMOTE_TPU", "PYTHON",
                                    "JAX", "JAXLIB", "LIBTPU", "ACCELERATOR", "TPU", "NOTES"]
        hosts = env["REMOTE_TPU_HOSTS"].split(",")
        for i, address in enumerate(hosts):
            row = lines[1 + i].split()
            assert row[:4] == [str(i), address, "yes", remote_tpu.__version__]
            assert row[-2:] == ["free", "ok"]
        assert "all hosts ready" in proc.stdout
        wrong = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor"],
                               env={**env, "REMOTE_TPU_TOKEN": new_token()},
                               capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 1 and "refused this client's credentials" in wrong.stdout
    finally:
        local.send_signal(signal.SIGINT)
        local.wait(15)


@pytest.mark.slow
def test_doctor_reports_a_busy_tpu_and_unreachable_hosts(tmp_path):
    lock = tmp_path / "libtpu_lockfile"
    vm = MetadataSlice("v4-16", 2, extra=["--tpu-lockfile", str(lock),
                                          "--simulate-devices", "0"])
    holder = hold_open(str(lock))
    try:
        env = {**os.environ, "REMOTE_TPU_TOKEN": vm.token}
        proc = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor", vm.addresses[1]],
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert f"pid {holder.pid}" in proc.stdout and "busy" in proc.stdout
        assert "v4-16" in proc.stdout
        vm.procs[1].kill()
        vm.procs[1].wait()
        proc = subprocess.run([sys.executable, "-m", "remote_tpu", "doctor", vm.addresses[0]],
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        row1 = [line for line in proc.stdout.splitlines() if line.startswith("1 ")][0]
        assert "NO" in row1 and "no remote_tpu agent answered" in row1
    finally:
        holder.kill()
        holder.wait()
        vm.stop()


@pytest.mark.slow
def test_a_preempted_host_ends_the_job_preempted():
    vm = MetadataSlice("v4-16", 2)
    try:
        @remote_tpu.run(accelerator="tpu-v4-16", hosts=vm.addresses[0], token=vm.token)
        def long_step():
            time.sleep(120)

        handle = long_step.submit()
        assert handle.status().state in ("QUEUED", "RUNNING")
        assert wait_until(lambda: handle.status().state == "RUNNING", timeout=30)
        vm.servers[1].instance["preempted"] = "TRUE"     # GCE takes worker 1 back ...
        vm.procs[1].send_signal(signal.SIGTERM)          # ... and shuts the VM down
        status = handle.wait(20)
        if status.state != "PREEMPTED":
            with pytest.raises(Exception) as ended:
                handle.result()
            pytest.fail(f"{status}\n{ended.value}")
        assert "host 1 was preempted" in status.detail
        with pytest.raises(remote_tpu.JobFailedError) as info:
            handle.result()
        assert info.value.host == 1 and "preempted" in str(info.value)
    finally:
        vm.stop()


# ------------------------------------------------------ tpu://NAME (Cloud TPU API)


@pytest.mark.slow
def test_tpu_name_resolves_to_its_workers_through_the_cloud_tpu_api(monkeypatch):
    vm = MetadataSlice("v4-16", 2)
    api = TpuApiStandIn({
        "projects/p/locations/z/nodes/my-tpu": tpu_node(vm.ips, "v4-16"),
        "projects/p/locations/z/nodes/creating": tpu_node(vm.ips, "v4-16", state="CREATING"),
    })
    monkeypatch.setenv("REMOTE_TPU_TPU_API", api.url)
    monkeypatch.setenv("REMOTE_TPU_TOKEN", vm.token)
    try:
        def ran_on():
            import jax
            return jax.process_count()

        url = f"tpu://my-tpu?zone=z&project=p&port={vm.port}"
        assert remote_tpu.run(accelerator="tpu-v4-16", hosts=url)(ran_on)() == 2
        from remote_tpu._cloud import resolve
        assert resolve(url) == (vm.addresses, "v4-16")
        external = [f"34.0.0.{i}:{vm.port}" for i in range(2)]
        assert resolve(url + "&external=1")[0] == external
        for bad, message in ((f"tpu://my-tpu?zone=z&project=p&port={vm.port}",
                              "asked for tpu-v5p-32, 4 host(s); tpu://my-tpu"),
                             ("tpu://nope?zone=z&project=p",
                              "there is no TPU 'nope' in zone z"),
                             ("tpu://creating?zone=z&project=p", "is CREATING, not READY")):
            with pytest.raises(ConfigurationError, match=re.escape(message)):
                remote_tpu.run(accelerator="tpu-v5p-32", hosts=bad)(ran_on)()
    finally:
        api.close()
        vm.stop()
