"""Wheels of remote-tpu's dependencies, with no network: each distribution
installed in this test environment packed again into a wheel (its files, as
its RECORD lists them), for a package index a "VM" with no internet installs
from as a real one installs from PyPI."""

from __future__ import annotations

import importlib.metadata
import os
import re

from packaging.requirements import Requirement

from remote_tpu._wheel import write_wheel

_SKIPPED_INFO = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def closure(root: str = "remote-tpu") -> list[importlib.metadata.Distribution]:
    """Every distribution ``root`` needs to run (its own extras left out),
    ``root`` excluded."""
    seen, todo, out = {(_name(root), frozenset())}, [(root, set())], []
    while todo:
        name, extras = todo.pop()
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": e})
                                      for e in (extras or {""})):
                continue
            key = (_name(req.name), frozenset(req.extras))
            if key in seen:
                continue                          # (a cycle, or met before)
            seen.add(key)
            todo.append((req.name, set(req.extras)))
            if _name(req.name) not in {_name(d.metadata["Name"]) for d in out}:
                out.append(importlib.metadata.distribution(req.name))
    return out


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def repack(dist: importlib.metadata.Distribution, directory: str) -> str:
    """``dist`` as installed here, as a wheel in ``directory`` (uncompressed:
    it is read once, on this machine)."""
    info_dir = next(str(f).split("/")[0] for f in dist.files
                    if str(f).split("/")[0].endswith(".dist-info"))
    files, dist_info = {}, {}
    for f in dist.files:
        path = str(f)
        if path.startswith("..") or "__pycache__" in path:
            continue                    # console scripts (pip writes them again), caches
        if path.startswith(info_dir + "/"):
            if path[len(info_dir) + 1:] not in _SKIPPED_INFO and "/" not in \
                    path[len(info_dir) + 1:]:
                with open(dist.locate_file(f), "rb") as fh:
                    dist_info[path[len(info_dir) + 1:]] = fh.read()
            continue
        source = str(dist.locate_file(f))
        if os.path.isfile(source):
            files[path] = source
    tags = [line.split(":", 1)[1].strip() for line in dist_info["WHEEL"].decode().splitlines()
            if line.startswith("Tag:")]
    tag = ".".join(sorted({t.split("-")[0] for t in tags})) + "-" + \
        ".".join(sorted({t.split("-")[1] for t in tags})) + "-" + \
        ".".join(sorted({t.split("-")[2] for t in tags}))
    return write_wheel(directory, dist.metadata["Name"], dist.version, tag, files, dist_info,
                       compress=False)


def dependency_wheels(directory: str) -> list[str]:
    """Wheels of everything remote-tpu needs, in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    return [repack(d, directory) for d in closure()]
