"""TPU lock hygiene: nothing but our own worker may hold the TPU when a job starts.

libtpu takes ``/tmp/libtpu_lockfile`` and opens the TPU device files
(``/dev/accel*`` on TPU VMs, ``/dev/vfio/*`` on newer ones). A lock file that no
live process holds open was left by a dead one: it is removed. A live holder
that is not this agent's blocks the job with an error naming its pid and
command line, or is killed when the agent runs with ``--kill-tpu-holders``.
Paths are configurable so tests (and unusual images) can use their own.

An agent whose devices are simulated (``--simulate-devices``: JAX on CPU) uses
no TPU, so it never looks at, removes or kills anything TPU: a CPU-only local
slice must not fail because this machine's real TPU is busy, nor delete a lock
that a real TPU job may still need. :meth:`TpuGuard.for_agent` picks the guard.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import time

log = logging.getLogger(__name__)

DEFAULT_LOCKFILE = "/tmp/libtpu_lockfile"
DEFAULT_DEVICES = ("/dev/accel*", "/dev/vfio/*")


class TpuBusy(Exception):
    """A process that is not ours holds the TPU."""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = _parent(pid)
    return False


def _holders(paths: set[str]) -> dict[int, str]:
    """pid -> one path it holds open, for every process holding one of ``paths``."""
    found: dict[int, str] = {}
    if not paths:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                found[pid] = target
                break
    return found


class TpuGuard:
    """Clears stale TPU locks before a job and refuses (or kills) foreign holders."""

    @classmethod
    def for_agent(cls, simulate_devices: int, lockfile: str = DEFAULT_LOCKFILE,
                  devices: tuple[str, ...] = DEFAULT_DEVICES,
                  kill_holders: bool = False) -> TpuGuard:
        """The guard of an agent: with simulated devices (``simulate_devices > 0``)
        one that touches nothing (:class:`NoTpu`), else the real one."""
        if simulate_devices > 0:
            log.debug("simulated devices: TPU locks and devices (%s, %s) are left alone",
                      lockfile, ", ".join(devices))
            return NoTpu()
        return cls(lockfile, devices, kill_holders)

    def __init__(self, lockfile: str = DEFAULT_LOCKFILE,
                 devices: tuple[str, ...] = DEFAULT_DEVICES,
                 kill_holders: bool = False) -> None:
        self.lockfile = lockfile
        self.devices = devices
        self.kill_holders = kill_holders

    def _paths(self) -> set[str]:
        paths = {os.path.realpath(self.lockfile)} if self.lockfile else set()
        for pattern in self.devices:
            paths.update(os.path.realpath(p) for p in glob.glob(pattern))
        return paths

    def _foreign(self) -> dict[int, str]:
        """Holders that are neither this agent nor anything it started."""
        return {pid: path for pid, path in _holders(self._paths()).items()
                if not _descends_from(pid, os.getpid())}

    def _remove_stale_lock(self) -> None:
        """Remove the lock file when no live process holds it, ours included (a
        running worker of this agent holds it while it uses the TPU)."""
        lock = os.path.realpath(self.lockfile) if self.lockfile else ""
        if lock and os.path.exists(lock) and not _holders({lock}):
            try:
                os.unlink(lock)
                log.warning("removed %s: no live process held it (left by a dead one)", lock)
            except OSError as exc:
                log.warning("cannot remove stale %s: %s", lock, exc)

    def describe(self, holders: dict[int, str]) -> str:
        return "; ".join(f"pid {pid} ({_cmdline(pid)}) holds {path}"
                         for pid, path in sorted(holders.items()))

    def busy(self) -> str:
        """Why a job could not start here now, or "" (stale locks are removed)."""
        holders = self._foreign()
        self._remove_stale_lock()
        if holders and not self.kill_holders:
            return (f"the TPU is in use by a process that is not remote_tpu's: "
                    f"{self.describe(holders)}. Stop it, or start the agent with "
                    "--kill-tpu-holders")
        return ""

    def prepare(self) -> None:
        """Before a job: clear stale locks; kill or refuse foreign holders."""
        holders = self._foreign()
        self._remove_stale_lock()
        if not holders:
            return
        if not self.kill_holders:
            raise TpuBusy(self.busy() or self.describe(holders))
        log.warning("killing TPU holders: %s", self.describe(holders))
        for pid in holders:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self._foreign():
            time.sleep(0.05)
        left = self._foreign()
        if left:
            raise TpuBusy(f"could not free the TPU: {self.describe(left)}")
        self._remove_stale_lock()

    def release(self) -> None:
        """After a job (its worker's group is gone): no lock is left behind."""
        self._remove_stale_lock()


class NoTpu(TpuGuard):
    """The guard of an agent whose devices are simulated: no TPU is used, so no
    TPU lock or device is ever looked at, removed or killed for. It watches no
    path at all, so even the inherited helpers find nothing to act on."""

    def __init__(self) -> None:
        super().__init__(lockfile="", devices=(), kill_holders=False)

    def busy(self) -> str:
        return ""

    def prepare(self) -> None:
        return None

    def release(self) -> None:
        return None
