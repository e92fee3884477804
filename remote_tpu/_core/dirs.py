"""Directories: made owner-only; caches kept as directories (a host's trees,
environments, gs:// copies), the ones used longest ago going first."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection


def prune_oldest(root: str, keep: int, protect: Collection[str] = (),
                 remove: Callable[[str], None] | None = None) -> None:
    """Keep the ``keep`` directories under ``root`` used last (by mtime: touch
    one as it is used) and those named in ``protect`` (paths); ``remove(path)``
    removes each other one (by default, the directory). Hidden ones (work in
    progress) are left alone."""
    try:
        entries = [e for e in os.scandir(root)
                   if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
    except FileNotFoundError:
        return
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    for entry in entries[keep:]:
        if entry.path not in protect:
            (remove or (lambda p: shutil.rmtree(p, ignore_errors=True)))(entry.path)


def make_private(path: str) -> None:
    """Make the directory ``path`` and every missing one above it owner-only
    (0700, as the XDG base directory spec asks of the directories it makes);
    one that exists is left as it is."""
    parent = os.path.dirname(os.path.abspath(path))
    if parent != os.path.abspath(path) and not os.path.isdir(parent):
        make_private(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
