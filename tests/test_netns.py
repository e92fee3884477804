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
from conftest import free_port, live_workers, wait_until
from remote_tpu._auth import TOKEN_ENV, new_token

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
        cmd = [sys.executable, "-m", "remote_tpu_agent", "--host", host, "--port", str(port),
               "--insecure", "--simulate-devices", "1", "--state-dir", self.state,
               "--log-level", "WARNING", *args]
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
