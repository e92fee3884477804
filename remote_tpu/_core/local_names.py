"""Names that come from elsewhere (a bucket's objects, a tree another machine
described, a job's output files) as paths under a local directory.

Such a name may be crafted: ``data//home/u/.bashrc`` (its rest is absolute:
``os.path.join`` drops the directory) or ``a/../../x``. ``local_path`` is the
one place that turns one into a path: it refuses what is not a plain relative
name, and what would land outside the directory through a symbolic link
already there.
"""

from __future__ import annotations

import os

RULE = ("a relative name of '/'-separated parts, none of them empty, '.' or '..', "
        "without backslashes or NUL characters, that stays inside its directory")


class UnsafeName(ValueError):
    """A name that cannot be written where it was meant to go (``why``)."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name!r} {why} (allowed: {RULE})")
        self.name, self.why = name, why


def problem(name: str) -> str:
    """Why ``name`` is not a plain relative name ("" when it is one)."""
    if not name:
        return "is empty"
    if "\0" in name:
        return "holds a NUL character"
    if "\\" in name:
        return "holds a backslash"
    if name.startswith("/"):
        return "is absolute"
    bad = [p for p in name.split("/") if p in ("", ".", "..")]
    if bad:
        return f"has {'an empty' if not bad[0] else repr(bad[0])} part"
    return ""


def local_path(root: str, name: str) -> str:
    """Where ``name`` (from outside) goes under the directory ``root``; raises
    UnsafeName where it is no plain relative name, or where a symbolic link
    already under ``root`` would take it elsewhere."""
    why = problem(name)
    if why:
        raise UnsafeName(name, why)
    path = os.path.join(root, *name.split("/"))
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise UnsafeName(name, f"leads to {real}, not inside {root}, through the symbolic link "
                               f"{_first_link(root, name)}")
    return path


def _first_link(root: str, name: str) -> str:
    """The first part of ``root/name`` below ``root`` that is a symbolic link."""
    path = root
    for part in name.split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return path
    return "(none found now)"
