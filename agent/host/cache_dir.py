"""Where an agent's argument cache lives: in memory (``/dev/shm``) when the
host has room there, else in the agent's state directory, or in a directory
of its own inside ``--cache-dir``; and the removal of memory caches whose
agents died without removing theirs."""

from __future__ import annotations

import logging
import os
import shutil

from remote_tpu._core import digests
from remote_tpu._core.dirs import make_private
from remote_tpu._core.exceptions import ConfigurationError

log = logging.getLogger(__name__)

_SHM_MIN_BYTES = 1 << 30     # a container's 64 MiB /dev/shm is no place for it


def cache_dir(given: str, state_dir: str) -> str:
    """The cache's directory: with ``--cache-dir`` (``given``: a place such as
    a mounted disk, which may hold other things), one of the agent's own
    inside it, made there (and ``given`` too, owner-only, where it is
    missing); it is only ever that one the agent empties and removes."""
    if not given:
        return default_dir(state_dir)
    if os.path.exists(given) and not os.path.isdir(given):
        raise ConfigurationError(f"--cache-dir {given} is not a directory: give a directory "
                                 "the agent may keep its argument cache in (it makes one of "
                                 "its own there, and leaves the rest alone)")
    try:
        make_private(given)
    except OSError as exc:
        raise ConfigurationError(f"--cache-dir {given}: cannot make it ({exc.strerror}): give "
                                 "a directory this user may write to") from None
    return os.path.join(given, _own_name(state_dir))


def _own_name(state_dir: str) -> str:
    """This agent's cache's name (an agent started again with the same state
    directory finds, and empties, its own)."""
    tag = digests.of(os.path.realpath(state_dir).encode()).hex()[:16]
    return f"{_SHM_PREFIX}{os.getuid()}-{tag}"


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
        return os.path.join("/dev/shm", _own_name(state_dir))
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
