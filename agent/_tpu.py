"""TPU lock hygiene: nothing but our own worker may hold the TPU when a job starts.

libtpu takes ``/tmp/libtpu_lockfile`` and opens the TPU device files
(``/dev/accel*`` on TPU VMs, ``/dev/vfio/*`` on newer ones). A lock file that no
live process holds open was left by a dead one: it is removed. A live holder
that is not this agent's blocks the job with an error naming its pid and
command line, or is killed when the agent runs with ``--kill-tpu-holders``.
Paths are configurable so tests (and unusual images) can use their own.
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

    def _remove_stale_lock(self, holders: dict[int, str]) -> None:
        lock = os.path.realpath(self.lockfile) if self.lockfile else ""
        if lock and os.path.exists(lock) and lock not in holders.values():
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
        self._remove_stale_lock(holders)
        if holders and not self.kill_holders:
            return (f"the TPU is in use by a process that is not remote_tpu's: "
                    f"{self.describe(holders)}. Stop it, or start the agent with "
                    "--kill-tpu-holders")
        return ""

    def prepare(self) -> None:
        """Before a job: clear stale locks; kill or refuse foreign holders."""
        holders = self._foreign()
        self._remove_stale_lock(holders)
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
        self._remove_stale_lock({})

    def release(self) -> None:
        """After a job (its worker's group is gone): no lock is left behind."""
        self._remove_stale_lock(self._foreign())
