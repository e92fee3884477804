"""Faults only separate hosts have: a link that goes dead. Each side runs in its
own network namespace joined by a veth pair (our own test hosts on 10.254.7.0/24).
Skipped where network namespaces cannot be made (not root, no `ip`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import remote_tpu
from conftest import free_port, live_workers, terminate_all, wait_until
from remote_tpu._core.auth import TOKEN_ENV, new_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NS = f"rtpu-{os.getpid()}"
HOST_SIDE, NS_SIDE = f"rtpa{os.getpid() % 100000}", f"rtpb{os.getpid() % 100000}"
HOST_IP, NS_IP = "10.254.7.1", "10.254.7.2"


def _ip(*args: str, ns: bool = False) -> None:
    cmd = (["ip", "netns", "exec", NS] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def link():
    """A fresh namespace and veth pair per test: a link brought back up keeps
    stale neighbour entries for a while."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    try:
        subprocess.run(["ip", "netns", "add", NS], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        _ip("link", "add", HOST_SIDE, "type", "veth", "peer", "name", NS_SIDE)
        _ip("link", "set", NS_SIDE, "netns", NS)
        _ip("addr", "add", f"{HOST_IP}/24", "dev", HOST_SIDE)
        _ip("link", "set", HOST_SIDE, "up")
        _ip("addr", "add", f"{NS_IP}/24", "dev", NS_SIDE, ns=True)
        _ip("link", "set", NS_SIDE, "up", ns=True)
        _ip("link", "set", "lo", "up", ns=True)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        pytest.skip(f"cannot wire the namespace: {exc.stderr}")
    yield
    subprocess.run(["ip", "link", "del", HOST_SIDE], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def _set_link(up: bool) -> None:
    _ip("link", "set", HOST_SIDE, "up" if up else "down")


class _Agent:
    def __init__(self, host: str, port: int, token: str, args: list[str],
                 in_ns: bool = False) -> None:
        self.state = tempfile.mkdtemp(prefix="netns-agent-")
        # No spare worker: these tests find a job's workers by the environment
        # they started with, which a spare (started before its job) does not show.
        cmd = [sys.executable, "-m", "remote_tpu_agent", "--host", host, "--port", str(port),
               "--insecure", "--simulate-devices", "1", "--state-dir", self.state,
               "--log-level", "WARNING", "--spare-workers", "0", *args]
        if in_ns:
            cmd = ["ip", "netns", "exec", NS, *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env={**os.environ, TOKEN_ENV: token})
        assert self.proc.stdout.readline().startswith("remote-tpu-agent listening on")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.proc.stdout.close()
        shutil.rmtree(self.state, ignore_errors=True)


def _workers(job_id: str) -> dict[int, object]:
    out = {}
    for p in live_workers():
        try:
            env = p.environ()
        except Exception:  # noqa: BLE001
            continue
        if env.get("REMOTE_TPU_JOB_ID") == job_id:
            out[int(env["REMOTE_TPU_HOST_INDEX"])] = p
    return out


def test_unreachable_peer_fails_the_job_within_the_peer_timeout(link):
    token = new_token()
    p0, p1 = free_port(), free_port()
    peers = f"{HOST_IP}:{p0},{NS_IP}:{p1}"
    peer = _Agent(NS_IP, p1, token, ["--worker-id", "1", "--peers", peers], in_ns=True)
    gateway = _Agent(HOST_IP, p0, token, ["--worker-id", "0", "--peers", peers,
                                          "--peer-timeout", "3"])
    try:
        @remote_tpu.run(accelerator="tpu-v4-16", hosts=f"{HOST_IP}:{p0}", token=token)
        def long_step():
            time.sleep(120)

        handle = long_step.submit()
        assert wait_until(lambda: len(_workers(handle.id)) == 2, 60)
        _set_link(False)
        cut = time.time()
        status = handle.wait(30)
        assert status.state == "FAILED"
        assert status.ended_at - cut < 3 + 4, f"took {status.ended_at - cut:.1f} s"
        with pytest.raises(remote_tpu.JobFailedError) as info:
            handle.result()
        assert info.value.host == 1 and "host 1: lost" in str(info.value)
        assert 0 not in _workers(handle.id)
        # The peer's agent notices its gateway is gone and stops its worker too.
        assert wait_until(lambda: not _workers(handle.id), 15)
    finally:
        _set_link(True)
        gateway.stop()
        peer.stop()


def test_client_whose_network_vanishes_has_its_attached_job_cancelled(link, tmp_path):
    token = new_token()
    port = free_port()
    gateway = _Agent(HOST_IP, port, token, [])
    script = textwrap.dedent(f"""
        import time, remote_tpu
        @remote_tpu.run(accelerator="tpu-v5litepod-4", hosts="{HOST_IP}:{port}",
                        token={token!r})
        def attached():
            import os
            print(os.environ["REMOTE_TPU_JOB_ID"], flush=True)
            time.sleep(120)
        attached()
    """)
    client_log = tmp_path / "client.log"
    with open(client_log, "w") as err:
        client = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", script],
                                  stdout=subprocess.PIPE, stderr=err, text=True,
                                  cwd=str(tmp_path))
    try:
        job_id = client.stdout.readline().strip()
        assert job_id, client_log.read_text()
        assert wait_until(lambda: len(_workers(job_id)) == 1, 60)
        _set_link(False)
        cut = time.monotonic()
        assert wait_until(lambda: not _workers(job_id), 10)
        assert time.monotonic() - cut < 5
        handle = remote_tpu.attach(job_id, hosts=f"{HOST_IP}:{port}", token=token)
        status = handle.wait(10)
        assert status.state == "CANCELLED" and "attached caller went away" in status.detail
    finally:
        _set_link(True)
        client.kill()
        client.wait()
        gateway.stop()


@pytest.fixture
def two_hosts(tmp_path):
    """Two namespaces joined by one veth pair, each with its own IP, hostname
    (w0, w1) and hosts file: separate hosts as far as JAX and Gloo can tell."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, iproute2 and unshare")
    names = [f"{NS}-h0", f"{NS}-h1"]
    ends = [f"rtph0{os.getpid() % 10000}", f"rtph1{os.getpid() % 10000}"]
    ips = ["10.254.9.1", "10.254.9.2"]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        subprocess.run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]],
                       check=True, capture_output=True)
        for name, end, ip in zip(names, ends, ips):
            subprocess.run(["ip", "link", "set", end, "netns", name], check=True,
                           capture_output=True)
            for args in (["addr", "add", f"{ip}/24", "dev", end], ["link", "set", end, "up"],
                         ["link", "set", "lo", "up"]):
                subprocess.run(["ip", "netns", "exec", name, "ip", *args], check=True,
                               capture_output=True)
        probe = subprocess.run(["ip", "netns", "exec", names[0], "unshare", "--uts", "--mount",
                                "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare --uts --mount is not allowed here: {probe.stderr!r}")
    except subprocess.CalledProcessError as exc:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make two namespaces: {exc.stderr!r}")
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" +
                          "".join(f"{ip} w{i}\n" for i, ip in enumerate(ips)))
    yield names, ips, str(hosts_file)
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _as_host(ns: str, hostname: str, hosts_file: str, argv: list[str]) -> list[str]:
    script = (f"hostname {hostname} && mount --bind {hosts_file} /etc/hosts && "
              'exec "$@"')
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "sh", "-c", script,
            "sh", *argv]


def test_collective_across_namespaces_each_with_its_own_hostname(two_hosts, tmp_path):
    names, ips, hosts_file = two_hosts
    token = new_token()
    port = free_port()
    agents = []
    try:
        for i, (ns, ip) in enumerate(zip(names, ips)):
            state = tempfile.mkdtemp(prefix="netns-host-")
            env = {**os.environ, TOKEN_ENV: token, "TPU_WORKER_ID": str(i),
                   "TPU_WORKER_HOSTNAMES": "w0,w1", "TPU_ACCELERATOR_TYPE": "v4-16"}
            argv = [sys.executable, "-m", "remote_tpu_agent", "--host", ip, "--port",
                    str(port), "--insecure", "--simulate-devices", "2", "--state-dir",
                    state, "--log-level", "WARNING"]
            proc = subprocess.Popen(_as_host(ns, f"w{i}", hosts_file, argv),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, env=env)
            agents.append(proc)
            assert proc.stdout.readline().startswith("remote-tpu-agent listening on")
        client = textwrap.dedent(f"""
            import socket, remote_tpu
            @remote_tpu.run(accelerator="tpu-v4-16", hosts="{ips[1]}:{port}", token={token!r})
            def gather():
                import socket
                import jax, jax.numpy as jnp
                from jax.experimental import multihost_utils
                names = multihost_utils.process_allgather(
                    jnp.array([ord(socket.gethostname()[-1])]))
                return [chr(int(n)) for n in names.ravel()], jax.device_count()
            print(socket.gethostname(), gather())
        """)
        done = subprocess.run(_as_host(names[1], "w1", hosts_file,
                                       [sys.executable, "-c", client]),
                              capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        # The client sat on host w1, asked worker 1, and was sent to worker 0.
        assert done.stdout.strip() == "w1 (['0', '1'], 4)"
    finally:
        terminate_all(agents, 15)
