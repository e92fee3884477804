"""TPU VMs as network namespaces, each with a real ``sshd`` (Debian's
openssh-server), a home directory of its own (mounted over /root in the sshd's
own mount namespace: root's files, venvs and token there are that VM's alone),
all on one bridge with this machine, which reaches them as a laptop reaches a
slice: by SSH, and then by the agents' port.

``SshVms.available()`` says why such VMs cannot be made here (not root, no
``ip``, ``unshare`` or ``sshd``), for tests to skip cleanly.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

_SSHD = "/usr/sbin/sshd"


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


class SshVms:
    """``n`` VMs, 10.254.S.10, .11, ... (S from this process id), the bridge at
    10.254.S.1. ``ssh_args`` are what a client passes ssh to reach them as root."""

    @staticmethod
    def available() -> str:
        if os.geteuid() != 0:
            return "network namespaces and sshd need root"
        for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        if not os.path.exists(_SSHD):
            return "sshd is not installed (apt-get install openssh-server)"
        return ""

    def __init__(self, n: int, accelerator: str = "") -> None:
        """``accelerator``: each VM also has a TPU VM's metadata server (its
        worker number, the slice's endpoints and type), found as on GCE by the
        name metadata.google.internal."""
        tag = os.getpid() % 100000
        subnet = 20 + os.getpid() % 200
        self.base = tempfile.mkdtemp(prefix="ssh-vms-")
        self.bridge = f"rtbr{tag}"
        self.host_ip = f"10.254.{subnet}.1"
        self.ips = [f"10.254.{subnet}.{10 + i}" for i in range(n)]
        self.namespaces = [f"rtvm{tag}-{i}" for i in range(n)]
        self._links = [f"rtv{tag}x{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._metadata = None                 # the VMs' metadata server, if any
        key = os.path.join(self.base, "client_key")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        self.ssh_args = ["--identity-file", key, "-o",
                         f"UserKnownHostsFile={os.path.join(self.base, 'known_hosts')}"]
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            os.makedirs("/run/sshd", exist_ok=True)
            if accelerator:
                self._serve_metadata(accelerator)
            for i in range(n):
                self._make(i, key + ".pub")
            for ip in self.ips:
                self._wait_for(ip, 22)
        except BaseException:
            self.close()
            raise

    def hostname(self, i: int) -> str:
        return f"t1v-n-test-w-{i}"

    def home(self, i: int) -> str:
        return os.path.join(self.base, f"vm{i}", "home")

    def _serve_metadata(self, accelerator: str) -> None:
        """One server on the bridge, port 80, answering each VM (known by its
        address) what its own metadata server would."""
        from metadata_server import HttpStandIn, tpu_vm

        vms = {ip: tpu_vm(i, self.ips, accelerator) for i, ip in enumerate(self.ips)}
        self.metadata_servers = list(vms.values())

        class ByAddress(HttpStandIn):
            def answer(self, client: str, path: str, headers: dict[str, str]):
                vm = vms.get(client)
                return vm.answer(client, path, headers) if vm else \
                    (404, {}, b"not a VM of this slice\n")

        self._metadata = ByAddress(host=self.host_ip, port=80)

    def _make(self, i: int, public_key: str) -> None:
        ns, link, ip = self.namespaces[i], self._links[i], self.ips[i]
        # `ip netns exec` puts /etc/netns/NS/hosts over /etc/hosts: the VM's names.
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{ip} {self.hostname(i)}\n"
                    f"{self.host_ip} metadata.google.internal\n")
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", link + "a", "type", "veth", "peer", "name", link + "b")
        _run("ip", "link", "set", link + "a", "master", self.bridge)
        _run("ip", "link", "set", link + "a", "up")
        _run("ip", "link", "set", link + "b", "netns", ns)
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", link + "b")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", link + "b", "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        vm = os.path.join(self.base, f"vm{i}")
        home = self.home(i)
        os.makedirs(os.path.join(home, ".ssh"), mode=0o700)
        shutil.copy(public_key, os.path.join(home, ".ssh", "authorized_keys"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(vm, "host_key"))
        config = os.path.join(vm, "sshd_config")
        with open(config, "w") as f:
            f.write(f"ListenAddress {ip}\nPort 22\nHostKey {vm}/host_key\n"
                    f"PidFile {vm}/sshd.pid\nPermitRootLogin prohibit-password\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "UsePAM no\nStrictModes no\nAuthorizedKeysFile .ssh/authorized_keys\n")
        # Its own /root (the VM's home) in a mount namespace of its own, and
        # its own hostname (which its /etc/hosts resolves, as a VM's does).
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation",
             "private", "--", "sh", "-c",
             f'hostname "$3" && mount --bind "$1" /root && exec {_SSHD} -D -e -f "$2"',
             "vm", home, config, self.hostname(i)],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(vm, "sshd.log"), "w"),
            start_new_session=True))

    @staticmethod
    def _wait_for(ip: str, port: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((ip, port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def run(self, i: int, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """``command`` on VM ``i`` over SSH, as root."""
        return subprocess.run(
            ["ssh", "-T", "-o", "BatchMode=yes", "-i", self.ssh_args[1], "-o",
             self.ssh_args[3], "-o", "StrictHostKeyChecking=accept-new",
             f"root@{self.ips[i]}", command],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def kill_agents(self) -> None:
        """Every process left in the VMs' namespaces (their agents, workers), then sshd."""
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass

    def close(self) -> None:
        self.kill_agents()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self._metadata is not None:
            self._metadata.close()
            for standin in self.metadata_servers:
                standin.close()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)
