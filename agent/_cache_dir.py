"""Where an agent's argument cache lives: in memory (``/dev/shm``) when the
host has room there, else in the agent's state directory; and the removal of
memory caches whose agents died without removing theirs."""

from __future__ import annotations

import logging
import os
import shutil

from remote_tpu._core import digests

log = logging.getLogger(__name__)

_SHM_MIN_BYTES = 1 << 30     # a container's 64 MiB /dev/shm is no place for it


def default_dir(state_dir: str) -> str:
    """In memory when this host has a writable ``/dev/shm`` of 1 GiB or more,
    named after the state directory (an agent started again with it empties
    it); else in the state directory."""
    try:
        shm = os.statvfs("/dev/shm")
        roomy = shm.f_frsize * shm.f_blocks >= _SHM_MIN_BYTES
    except OSError:
        roomy = False
    if roomy and os.access("/dev/shm", os.W_OK):
        tag = digests.of(os.path.realpath(state_dir).encode()).hex()[:16]
        return os.path.join("/dev/shm", f"{_SHM_PREFIX}{os.getuid()}-{tag}")
    return os.path.join(state_dir, "blobs")


_SHM_PREFIX = "remote-tpu-cache-"
OWNER_FILE = "owner"          # the pid of the agent whose cache it is


def sweep_orphans(mine: str) -> None:
    """Remove the memory caches of this user's agents that died without
    removing theirs (SIGKILL, the OOM killer): memory nobody would give back.
    A cache whose agent still runs, or that names none, is left alone."""
    parent, name = os.path.split(mine)
    prefix = f"{_SHM_PREFIX}{os.getuid()}-"
    if parent != "/dev/shm" or not name.startswith(prefix):
        return
    for other in os.listdir(parent):
        path = os.path.join(parent, other)
        if not other.startswith(prefix) or path == mine:
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)
            continue                              # its agent runs
        except (OSError, ValueError) as exc:
            if not isinstance(exc, ProcessLookupError):
                continue                          # no owner named, or not ours to judge
        log.warning("removing %s: the agent that kept its argument cache there is gone",
                    path)
        shutil.rmtree(path, ignore_errors=True)
