"""The agents that have answered this machine before, remembered across
processes: a call that finds nothing listening at one of them waits for it
(an agent restarting, a slice coming back) for ``_target.RETRY_SECONDS``; an
address that never answered fails in about a second, as a typo should.

Kept in ``$XDG_STATE_HOME/remote_tpu/answered`` (owner-only), the newest
``KEEP`` addresses, one a line; read once per process, written when an
address answers for the first time.
"""

from __future__ import annotations

import os
import threading

from ._core.dirs import make_private

KEEP = 256
_lock = threading.Lock()
_known: set[str] | None = None


def _path() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    return os.path.join(base, "remote_tpu", "answered")


def _load() -> set[str]:
    global _known
    if _known is None:
        try:
            with open(_path(), encoding="utf-8") as f:
                _known = {line.strip() for line in f if line.strip()}
        except (OSError, UnicodeDecodeError):
            _known = set()
    return _known


def before(address: str) -> bool:
    """Whether the agent at ``address`` has answered this machine before."""
    with _lock:
        return address in _load()


def note(address: str) -> None:
    """``address`` answered: remembered (a set lookup when it already is)."""
    with _lock:
        known = _load()
        if address in known:
            return
        known.add(address)
        _save(address)


def _save(address: str) -> None:
    path = _path()
    try:
        make_private(os.path.dirname(path))
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f if line.strip() and line.strip() != address]
        except FileNotFoundError:
            lines = []
        lines = [*lines, address][-KEEP:]
        tmp = f"{path}.{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("".join(f"{line}\n" for line in lines))
        os.replace(tmp, path)
    except OSError:
        pass            # only a memory: a call goes on without it
