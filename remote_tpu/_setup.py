"""``remote-tpu setup``: make every host of a slice ready and start its agent,
all hosts at once, over SSH (the script each runs: ``_host_setup``).

Hosts are SSH addresses in worker order (``[USER@]HOST[:SSH_PORT]``), or a
``tpu://NAME?zone=Z`` reference whose workers the Cloud TPU API lists (reached
as gcloud reaches them: your user name, gcloud's key
``~/.ssh/google_compute_engine``). Each host gets this client's own remote-tpu
(``_wheel``), jax and jaxlib at the client's versions (``jax[tpu]`` where a TPU
is present), the slice token (over the SSH channel), and its agent, started
under systemd where it runs; then the doctor checks the slice.
"""

from __future__ import annotations

import collections
import dataclasses
import getpass
import ipaddress
import os
import re
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from . import _host_setup
from ._core.addresses import DEFAULT_AGENT_PORT, TpuRef, join_host_port
from ._core.auth import client_token, default_token_file, new_token, read_token_file, \
    write_token_file
from ._core.exceptions import ConfigurationError, RemoteTPUError
from ._core.versions import local_versions

DEFAULT_DIR = "~/.local/share/remote-tpu"
_TAIL_LINES = 20
_LINE_BYTES = 4096                 # of each line a host prints (the rest is cut, and said)
_AT_ONCE = 16                      # ssh connections at once (sshd's MaxStartups begins at 10)
# Agent flags setup gives itself, and install-service's own (any abbreviation of them).
_OWN_FLAGS = ("--port", "--worker-id", "--peers", "--host", "--token-file", "--user",
              "--dry-run", "--unit-path")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_GCLOUD_KEY = os.path.join("~", ".ssh", "google_compute_engine")


class SetupError(RemoteTPUError):
    """One or more hosts could not be made ready; the message names each."""


@dataclasses.dataclass(frozen=True)
class SshHost:
    """One host as ssh reaches it, and the address its agent will have."""

    index: int
    user: str          # "" = ssh's default
    host: str
    ssh_port: int

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    def name(self) -> str:
        return f"host {self.index} ({self.host})"

    @classmethod
    def parse(cls, index: int, text: str) -> SshHost:
        user, at, rest = text.rpartition("@")
        host, port, well_formed = rest, 22, True
        if rest.startswith("["):                           # [v6] or [v6]:port
            host, closed, tail = rest[1:].partition("]")
            well_formed = bool(closed) and (tail == "" or tail.startswith(":"))
            if well_formed and tail:
                port = _port(text, tail[1:])
        elif rest.count(":") == 1:
            host, _, p = rest.partition(":")
            port = _port(text, p)
        if not (well_formed and host and not host.startswith("-") and
                not any(c.isspace() for c in text) and (not at or _USER.fullmatch(user))):
            raise ConfigurationError(f"{text!r} is not an SSH address: give [USER@]HOST[:PORT], "
                                     "e.g. me@10.0.0.2 or 10.0.0.2:2222")
        return cls(index, user, host, port)


def _port(text: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"{text!r}: SSH port {port!r} is not a port (1-65535)")
    return int(port)


@dataclasses.dataclass
class HostResult:
    host: SshHost
    ok: bool = False
    summary: str = ""                  # "started", "unchanged", or why it failed
    proc: subprocess.Popen | None = None           # its ssh, while it runs
    tail: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every host gets: the same for all but the agent's place."""

    hosts: tuple[SshHost, ...]
    port: int = DEFAULT_AGENT_PORT
    ssh_args: tuple[str, ...] = ()
    directory: str = DEFAULT_DIR
    pip_index: str = ""
    agent_flags: tuple[str, ...] = ()
    # Give each agent --worker-id and --peers (hosts named by address); a TPU
    # VM's agent finds its place in its metadata instead.
    explicit_places: bool = True

    def flags_for(self, host: SshHost) -> list[str]:
        flags = ["--host", "0.0.0.0"]
        if "--tls-cert" not in " ".join(self.agent_flags):
            flags.append("--insecure")
        if self.explicit_places:
            flags += ["--worker-id", str(host.index), "--peers",
                      ",".join(join_host_port(ip, self.port) for ip in peer_ips(self.hosts))]
        return flags + list(self.agent_flags)

    def ssh(self, host: SshHost, command: str) -> list[str]:
        return ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15",
                "-o", "StrictHostKeyChecking=accept-new", "-o", "ServerAliveInterval=15",
                "-o", "LogLevel=ERROR",
                "-p", str(host.ssh_port), *self.ssh_args, "--", host.target, command]


def peer_ips(hosts: Sequence[SshHost]) -> list[str]:
    """The hosts' addresses as their peers reach them: names resolved here
    (an ssh_config alias means nothing on the hosts: give addresses), and
    never a loopback address for a slice of several hosts."""
    out = []
    for h in hosts:
        try:
            ip = socket.getaddrinfo(h.host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        except OSError:
            raise ConfigurationError(
                f"{h.host!r} does not resolve here, so its peers could not reach it by that "
                "name (an ssh_config alias?): give the hosts' addresses") from None
        if len(hosts) > 1 and ipaddress.ip_address(ip).is_loopback:
            raise ConfigurationError(
                f"{h.target} is a loopback address ({ip}): the other hosts cannot reach it "
                "there (a port forward?); give each host's own address")
        out.append(ip)
    return out


def hosts_of(targets: Sequence[str], user: str = "",
             internal_ip: bool = False) -> tuple[list[SshHost], bool]:
    """(the hosts, whether they came from a ``tpu://`` reference: reached at
    their external IPs where they have them, as gcloud does, unless
    ``internal_ip``)."""
    if user and not _USER.fullmatch(user):
        raise ConfigurationError(f"--user {user!r} is not a user name (letters, digits, "
                                 "'.', '_', '-')")
    if not targets:
        raise ConfigurationError("which hosts? give their SSH addresses in worker order "
                                 "(me@10.0.0.2 me@10.0.0.3 ...), or tpu://NAME?zone=ZONE")
    if any(t.startswith("tpu://") for t in targets):
        if len(targets) != 1:
            raise ConfigurationError("give one tpu://NAME?zone=ZONE, or SSH addresses, "
                                     "not both")
        from ._cloud import workers
        ref = TpuRef.parse(targets[0])
        ips, _ = workers(ref, prefer_external=not internal_ip)
        name = user or getpass.getuser().lower()
        return [SshHost(i, name, ip, 22) for i, ip in enumerate(ips)], True
    hosts = [SshHost.parse(i, t) for i, t in enumerate(targets)]
    if user:
        hosts = [dataclasses.replace(h, user=h.user or user) for h in hosts]
    seen = [(h.host, h.ssh_port) for h in hosts]
    if len(set(seen)) != len(seen):
        raise ConfigurationError("the same host is named twice: give each host once, in "
                                 "worker order")
    return hosts, False


def slice_token(path: str = "") -> tuple[str, str]:
    """(the token, a note when one was made): ``path``, else the one this
    client sends ($REMOTE_TPU_TOKEN, $REMOTE_TPU_TOKEN_FILE, the default token
    file), else a new default token file."""
    if path:
        return read_token_file(path), ""
    token = client_token(None)
    if token:
        return token, ""
    path = default_token_file()
    write_token_file(path, new_token())
    return read_token_file(path), f"made a new slice token in {path} (mode 0600)"


def setup(plan: Plan, token: str, say: Callable[[str], None] = print) -> list[HostResult]:
    """Run the host script on every host at once; each host's steps go to
    ``say`` as they come. Returns every host's result (never raises for a host)."""
    from ._wheel import client_wheel

    versions = local_versions()
    minor = ".".join(versions["python"].split(".")[:2])
    with tempfile.TemporaryDirectory(prefix="remote-tpu-setup-") as tmp:
        wheel, digest = client_wheel(tmp)
        with open(wheel, "rb") as f:
            payload = token.encode() + b"\n" + f.read()
        want = f"{versions['remote_tpu']} {digest[:16]} jax={versions['jax']} " \
               f"jaxlib={versions['jaxlib']}"
        results = [HostResult(h) for h in plan.hosts]
        at_once = threading.BoundedSemaphore(_AT_ONCE)
        threads = [threading.Thread(target=_one_host, daemon=True,
                                    args=(plan, r, payload, say, at_once,
                                          _host_setup.remote_command(
                                        plan.directory, minor, want, plan.pip_index,
                                        versions["jax"], versions["jaxlib"], plan.port,
                                        os.path.basename(wheel), plan.flags_for(r.host))))
                   for r in results]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except KeyboardInterrupt:
            for r in results:
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.terminate()
            unfinished = [str(r.host.index) for r in results if not r.ok]
            say(f"setup interrupted: host(s) {', '.join(unfinished) or 'none'} may be half "
                "set up (a script already running there finishes its step; whatever did not "
                "finish is done again next time); run setup again")
            raise
    return results


def _one_host(plan: Plan, result: HostResult, payload: bytes, say: Callable[[str], None],
              at_once: threading.BoundedSemaphore, command: str) -> None:
    name = result.host.name()
    with at_once:
        try:
            proc = result.proc = subprocess.Popen(
                plan.ssh(result.host, command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT)
        except OSError as exc:
            result.summary = f"could not run ssh: {exc.strerror}"
            return
        feeder = threading.Thread(target=_feed, args=(proc, payload), daemon=True)
        feeder.start()
        while raw := proc.stdout.readline(_LINE_BYTES):
            line = raw.decode(errors="replace").rstrip()
            if len(raw) == _LINE_BYTES and not raw.endswith(b"\n"):
                line += " [cut: the line goes on]"
                while (more := proc.stdout.readline(_LINE_BYTES)) and not more.endswith(b"\n"):
                    pass
            if line.startswith("@@done "):
                result.ok, result.summary = True, line[7:]
            elif line.startswith("@@failed "):
                result.summary = line[9:]
            elif line.startswith("@@ "):
                say(f"{name}: {line[3:]}")
            elif line:
                result.tail.append(line)
        code = proc.wait()
        feeder.join()
    if code != 0 and result.ok:
        result.ok = False
        result.summary = f"ssh ended with status {code} after the host said: {result.summary}"
    if not result.ok and not result.summary:
        result.summary = _ssh_failure(code, result)
    say(f"{name}: {'ready: ' if result.ok else 'FAILED: '}{result.summary}")


def _feed(proc: subprocess.Popen, payload: bytes) -> None:
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except OSError:
        pass                 # the host's script ended early: its output says why


def _ssh_failure(code: int, result: HostResult) -> str:
    text = "\n".join(result.tail)
    if code == 255 and "Permission denied" in text:
        return (f"ssh was refused as {result.host.target} (Permission denied): the host does "
                "not know your key for that user. "
                "For a TPU VM, `gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all "
                "--command true` once puts gcloud's key on every worker; else give your key "
                "with --identity-file")
    if code == 255 and "IDENTIFICATION HAS CHANGED" in text:
        return ("the host's SSH key is not the one your known_hosts has for this address "
                "(a new VM at an old address?): remove the old entry "
                f"(ssh-keygen -R {result.host.host}) and run setup again")
    if code == 255:
        return "ssh could not reach the host (exit 255)"
    return f"the setup script ended with exit status {code}"


def report(results: Sequence[HostResult]) -> str:
    """Why setup failed, host by host, with the last lines of each failing
    host's output; "" when every host is ready."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return ""
    ready = [str(r.host.index) for r in results if r.ok]
    parts = [f"{len(failed)} of {len(results)} host(s) failed:"]
    for r in failed:
        parts.append(f"\n{r.host.name()}: {r.summary}")
        if r.tail:
            parts.append("  its last lines:\n" + "\n".join(f"    {line}" for line in r.tail))
    several = len(ready) > 1
    parts.append("\n" + (f"Host{'s' * several} {', '.join(ready)} "
                         f"{'are' if several else 'is'} ready, "
                         f"{'their agents' if several else 'its agent'} running. "
                         if ready else "") +
                 "Fix the host(s) above and run setup again: it redoes only what differs.")
    return "\n".join(parts)


def doctor_text(plan: Plan, token: str) -> tuple[str, bool]:
    """The doctor's table for the slice, asked from here; where this machine
    cannot reach the agents' port, asked on host 0 over SSH. (text, all ready)."""
    from ._doctor import doctor_if_reachable, format_table

    host = plan.hosts[0]
    asked = doctor_if_reachable([join_host_port(host.host, plan.port)], token=token)
    if asked is not None:
        rows, problems = asked
        text = format_table(rows)
        if problems:
            text += "\n\nproblems:\n" + "\n".join(f"- {p}" for p in problems)
        return text, not problems
    where = plan.directory.rstrip("/") or "/"
    where = ('"$HOME"' + shlex.quote(where[1:]) if where.startswith("~/") or where == "~"
             else shlex.quote(where))
    command = f"{where}/venv/bin/remote-tpu doctor 127.0.0.1:{plan.port}"
    tunnel = (f"reach the slice through a tunnel, e.g. `ssh -N -L {plan.port}:localhost:"
              f"{plan.port} {host.target}` and hosts='localhost:{plan.port}'")
    try:
        done = subprocess.run(plan.ssh(host, command), capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError) as exc:
        return (f"(this machine cannot reach port {plan.port} of {host.host}, and the doctor "
                f"on host 0 did not answer: {exc}); {tunnel}"), False
    text = (f"(this machine cannot reach port {plan.port} of {host.host}: the doctor ran on "
            f"host 0; {tunnel})\n" + (done.stdout + done.stderr).strip())
    return text, done.returncode == 0


def _agent_flags(agent_args: str) -> tuple[str, ...]:
    """``--agent-args``, split, refusing the flags setup gives itself (or any
    abbreviation of one, which the agent's parser would take for it)."""
    try:
        flags = tuple(shlex.split(agent_args))
    except ValueError as exc:
        raise ConfigurationError(f"--agent-args {agent_args!r}: {exc}") from None
    for flag in flags:
        name = flag.partition("=")[0]
        taken = [own for own in _OWN_FLAGS if name.startswith("--") and len(name) > 2
                 and own.startswith(name)]
        if taken:
            raise ConfigurationError(
                f"--agent-args: {name} is (or abbreviates) {taken[0]}, which setup gives the "
                "agents itself (setup's own --agent-port sets the port)")
    return flags


def main(targets: Sequence[str], *, user: str = "", identity_file: str = "",
         ssh_options: Sequence[str] = (), port: int = DEFAULT_AGENT_PORT,
         directory: str = DEFAULT_DIR, pip_index: str = "", agent_args: str = "",
         token_file: str = "", internal_ip: bool = False,
         say: Callable[[str], None] = print) -> list[str]:
    """``remote-tpu setup``: every host ready and its agent started, the
    doctor's table printed. Returns the agents' addresses (worker order)."""
    if not 0 < port < 65536:
        raise ConfigurationError(f"--agent-port {port}: give the agents' port, 1-65535")
    flags = _agent_flags(agent_args)
    hosts, from_api = hosts_of(targets, user, internal_ip)
    ssh_args = []
    key = identity_file or (os.path.expanduser(_GCLOUD_KEY) if from_api else "")
    if key and not os.path.exists(os.path.expanduser(key)):
        raise ConfigurationError(f"no SSH key at {key}: give --identity-file, or let gcloud "
                                 "make its key (`gcloud compute tpus tpu-vm ssh NAME --zone "
                                 "ZONE --worker=all --command true`)")
    if key:
        ssh_args += ["-i", os.path.expanduser(key)]
    for option in ssh_options:
        ssh_args += ["-o", option]
    plan = Plan(tuple(hosts), port, tuple(ssh_args), directory, pip_index, flags,
                explicit_places=not from_api)
    token, note = slice_token(token_file)
    if note:
        say(note)
    say(f"setting up {len(hosts)} host(s): {', '.join(h.target for h in hosts)}")
    started = time.monotonic()
    results = setup(plan, token, say)
    failure = report(results)
    if failure:
        raise SetupError(failure)
    say(f"{len(hosts)} host(s) ready in {time.monotonic() - started:.1f} s")
    text, ready = doctor_text(plan, token)
    say(text)
    addresses = [join_host_port(h.host, port) for h in hosts]
    if not ready:
        raise SetupError("every host was set up, but the doctor found problems (above)")
    say(f"\nready: hosts='{addresses[0]}'" + ("" if not from_api else
                                                f" or hosts='{targets[0]}'"))
    return addresses

