"""The local slice: one agent process per simulated host on 127.0.0.1.

Agents are reused across calls in the same Python process and stopped at exit.
They listen on loopback only and accept nothing but a token made afresh for this
client process (given to them in their environment, never on a command line).
Each agent watches its standard input, a pipe from this process: when this
process dies, even by SIGKILL, the pipe closes and the agent shuts down, and
each worker likewise dies with its agent.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from ._core.auth import TOKEN_ENV, new_token
from ._core.exceptions import AgentUnavailableError
from ._core.topology import Topology
from ._core.channels import Credentials

log = logging.getLogger(__name__)

_READY_PREFIX = "remote-tpu-agent listening on "
_START_TIMEOUT = 60.0
# A spare worker imports jax ahead of its job (~0.8 s of CPU and ~150 MB each):
# worth it for a few simulated hosts, not for 64 on one machine, whose agents
# keep light spares (no jax: 0.1 s and 19 MB each).
_SPARES_UP_TO_HOSTS = 8
# All the simulated hosts' argument caches together (in memory) take at most
# this share of the machine's memory.
_CACHE_SHARE = 0.25


def _cache_bytes(hosts: int) -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(64 << 20, min(8 << 30, int(total * _CACHE_SHARE) // hosts))


_PREFIX = "remote-tpu-local-"
_OWNER_FILE = "client.pid"


def _sweep_abandoned() -> None:
    """Remove the files of local slices whose client process is gone without
    removing them (killed: its exit handlers never ran)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _PREFIX + "*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER_FILE)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue                 # not ours to judge
        try:
            os.kill(pid, 0)
            continue                 # its client runs (or the pid is another's now)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


class LocalSlice:
    """``hosts`` simulated hosts; with ``num_slices`` > 1, that many slices of
    ``hosts`` hosts each (N x hosts agents, worker ids 0.. in each slice)."""

    def __init__(self, hosts: int, devices_per_host: int, num_slices: int = 1) -> None:
        self.per_slice = hosts
        self.hosts = hosts * num_slices
        self.devices_per_host = devices_per_host
        _sweep_abandoned()
        self.log_dir = tempfile.mkdtemp(prefix=_PREFIX)
        with open(os.path.join(self.log_dir, _OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        # A fresh secret per client process: other local users cannot use these agents.
        self.credentials = Credentials(token=new_token())

    def start(self) -> None:
        for i in range(self.hosts):
            log_file = open(os.path.join(self.log_dir, f"agent-{i}.log"), "ab")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "remote_tpu_agent", "--host", "127.0.0.1",
                 "--port", "0", "--worker-id", str(i % self.per_slice),
                 "--simulate-devices", str(self.devices_per_host),
                 "--state-dir", os.path.join(self.log_dir, f"state-{i}"),
                 "--exit-with-stdin", "--log-level", "WARNING",
                 "--spare-workers", "1",
                 *([] if self.hosts <= _SPARES_UP_TO_HOSTS else ["--light-spares"]),
                 "--cache-bytes", str(_cache_bytes(self.hosts))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                start_new_session=True, env={**os.environ, TOKEN_ENV: self.credentials.token},
            ))
            log_file.close()
        deadline = time.monotonic() + _START_TIMEOUT
        for i, proc in enumerate(self.procs):
            self.addresses.append(self._await_ready(i, proc, deadline))

    def _await_ready(self, i: int, proc: subprocess.Popen, deadline: float) -> str:
        assert proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(proc.stdout.readline().decode()),
                                  daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        line = result[0] if result else ""
        if not line.startswith(_READY_PREFIX):
            self.stop(keep_files=True)          # its log is named below
            log_path = os.path.join(self.log_dir, f"agent-{i}.log")
            try:
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-2000:]
            except OSError:
                tail = ""
            raise AgentUnavailableError(
                f"local agent {i} did not start within {_START_TIMEOUT:g} s "
                f"(exit code {proc.poll()}); its log {log_path} ends with:\n{tail}")
        return line[len(_READY_PREFIX):].strip()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def stop(self, keep_files: bool = False) -> None:
        """Stop the agents, and remove their logs and state (job records, kept
        results: a 1 GiB result is 1 GiB on disk) unless ``keep_files``."""
        for proc in self.procs:
            try:
                if proc.stdin:
                    proc.stdin.close()     # the agent shuts down on EOF
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        self.procs = []
        if not keep_files:
            shutil.rmtree(self.log_dir, ignore_errors=True)


_slices: dict[tuple[int, int, int], LocalSlice] = {}
_lock = threading.Lock()


def get_local_slice(topology: Topology, num_slices: int = 1) -> LocalSlice:
    """The running local slice for this shape (``num_slices`` of them),
    started on first use."""
    key = (topology.hosts, topology.devices_per_host, num_slices)
    with _lock:
        s = _slices.get(key)
        if s is not None and not s.alive():
            s.stop()
            s = None
        if s is None:
            s = LocalSlice(*key)
            s.start()
            _slices[key] = s
        return s


def running_local_slices(topology: Topology | None = None) -> list[LocalSlice]:
    """The local slices this process runs now (of ``topology``'s shape only,
    when given); none is started."""
    with _lock:
        return [s for key, s in _slices.items() if s.alive() and (
            topology is None or key[:2] == (topology.hosts, topology.devices_per_host))]


def stop_local_slices() -> None:
    with _lock:
        for s in _slices.values():
            s.stop()
        _slices.clear()


atexit.register(stop_local_slices)
