"""Versions this side of the wire speaks, and the one rule of who can work with whom.

Client, agent (a job spec's client versions), gateway (each peer before a job),
``remote-tpu doctor`` and every unpickled envelope ask ``differences``.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .exceptions import VersionMismatchError

if TYPE_CHECKING:       # protobuf is imported only where a message is made or read
    from .proto import remote_tpu_pb2 as pb

__version__ = "0.1.0"

# Bump on any wire change an older peer could misread.
PROTOCOL_VERSION = 9
_FIELDS = ("protocol", "remote_tpu", "python", "cloudpickle", "jax", "jaxlib", "libtpu")
# What every host of a slice must run alike (JAX's maintainers' first question on
# a multi-host bug); Python by its minor version.
SLICE_FIELDS = ("remote_tpu", "python", "jax", "jaxlib", "libtpu")


def _dist_version(name: str, absent_is_likely: bool = False) -> str:
    """The installed distribution's version, as ``importlib.metadata.version``
    says it, without importing ``importlib.metadata`` where it can (that alone
    took 30-50 ms of the start of every agent and light spare, and its lookup
    ~4 ms more). Like it, the first ``sys.path`` entry that holds the name's
    metadata answers: read here when that is one ``.dist-info`` directory;
    anything else (an ``.egg-info``, an ``.egg``, a zip file, two candidates in
    one directory, none anywhere) is left to ``importlib.metadata`` itself:
    but for ``absent_is_likely`` (libtpu off a TPU VM), none anywhere is "",
    without that import's 30-50 ms."""
    wanted = _normalised(name)
    for entry in sys.path:
        where = os.fspath(entry) or "."
        if os.path.isfile(where):              # a zip: importlib.metadata looks inside
            return _importlib_version(name)
        try:
            found = [d for d in os.listdir(where)
                     if d.lower().endswith((".dist-info", ".egg-info", ".egg"))
                     and _normalised(d.lower().rpartition(".")[0].partition("-")[0]) == wanted]
        except OSError:
            continue
        if len(found) == 1 and found[0].lower().endswith(".dist-info"):
            return _metadata_version(os.path.join(where, found[0], "METADATA"))
        if found:
            return _importlib_version(name)
    if absent_is_likely:
        return ""
    return _importlib_version(name)         # (a finder of distributions of its own, say)


def _importlib_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name) or ""     # (None: no Version)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_version(path: str) -> str:
    """The ``Version:`` header of a METADATA file, as ``importlib.metadata``
    reads it ("" when it has none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line[len("Version:"):].lstrip(" \t").rstrip("\r\n")
                if not line.strip():        # the headers end here
                    break
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def local_versions() -> dict[str, str | int]:
    """Versions of this process, without importing jax."""
    return {
        "protocol": PROTOCOL_VERSION,
        "remote_tpu": __version__,
        "python": platform.python_version(),
        "cloudpickle": _dist_version("cloudpickle"),
        "jax": _dist_version("jax"),
        "jaxlib": _dist_version("jaxlib", absent_is_likely=True),
        "libtpu": (_dist_version("libtpu", absent_is_likely=True)
                   or _dist_version("libtpu-nightly", absent_is_likely=True)),
    }


def versions_pb() -> pb.Versions:
    """This process's versions, as sent on the wire."""
    from .proto import remote_tpu_pb2 as pb

    v = local_versions()
    return pb.Versions(protocol=int(v["protocol"]), remote_tpu=str(v["remote_tpu"]),
                       python=str(v["python"]), cloudpickle=str(v["cloudpickle"]),
                       jax=str(v["jax"]), jaxlib=str(v["jaxlib"]), libtpu=str(v["libtpu"]))


def differences(theirs: Mapping[str, Any] | pb.Versions, *, releases: bool = False,
                there: str = "there", here: str = "here",
                interpreter: bool = True) -> list[str]:
    """What differs between ``theirs`` and this process that stops them working
    together: the wire protocol; the Python minor version and the cloudpickle
    release (cloudpickle ships code objects by value, which load only in the
    same Python minor version, and its format is stable only within a release).
    With ``releases``, also the remote_tpu and jax releases (which work together,
    but should not differ on one slice). Empty when nothing matters."""
    if not isinstance(theirs, Mapping):          # a Versions message
        theirs = {f: getattr(theirs, f) for f in _FIELDS}
    a = {f: str(theirs.get(f, "") or "?") for f in _FIELDS}       # theirs
    b = {f: str(v) for f, v in local_versions().items()}          # ours
    problems = []
    if a["protocol"] != b["protocol"]:
        problems.append(f"protocol {a['protocol']} (remote_tpu {a['remote_tpu']}) {there}, "
                        f"protocol {b['protocol']} (remote_tpu {b['remote_tpu']}) {here}")
    if not interpreter:       # an agent runs workers on the client's Python (_pythons)
        return problems
    if a["python"].split(".")[:2] != b["python"].split(".")[:2]:
        problems.append(f"Python {a['python']} {there}, {b['python']} {here}")
    if a["cloudpickle"] != b["cloudpickle"]:
        problems.append(f"cloudpickle {a['cloudpickle']} {there}, {b['cloudpickle']} {here}")
    if releases:
        for name in ("remote_tpu", "jax", "jaxlib", "libtpu"):
            if b[name] and a[name] != b[name]:
                problems.append(f"{name} {a[name]} {there}, {b[name]} {here}")
    return problems


def check_compatible(theirs: Mapping[str, Any] | pb.Versions, *, sender: str,
                     receiver: str = "this process", interpreter: bool = True) -> None:
    """Raise VersionMismatchError when ``differences`` finds any, naming both
    sides: ``sender`` (whose versions are ``theirs``) and ``receiver`` (us);
    ``interpreter=False``: the wire protocol only."""
    problems = differences(theirs, there=f"on {sender}", here=f"on {receiver}",
                           interpreter=interpreter)
    if problems:
        raise VersionMismatchError(
            f"{sender} cannot work with {receiver}: " + "; ".join(problems)
            + ". Install the same remote_tpu release, Python minor version and cloudpickle "
            "release on the client and on every host.")


def _as_dict(v: Mapping[str, Any] | pb.Versions) -> dict[str, str]:
    if not isinstance(v, Mapping):
        v = {f: getattr(v, f) for f in _FIELDS}
    return {f: str(v.get(f, "") or "") for f in _FIELDS}


def _alike(field: str, value: str) -> str:
    return ".".join(value.split(".")[:2]) if field == "python" else value


def slice_skew(hosts: Mapping[str, Mapping[str, Any] | pb.Versions]) -> list[str]:
    """Which of ``SLICE_FIELDS`` differ between these hosts (by name), each
    said with every host's value: empty when they all match."""
    rows = {name: _as_dict(v) for name, v in hosts.items()}
    said = []
    for field in SLICE_FIELDS:
        if len({_alike(field, r[field]) for r in rows.values()}) > 1:
            values = ", ".join(f"{name} {r[field] or 'none'}" for name, r in rows.items())
            said.append(f"{field}: {values}")
    return said


def skew_table(hosts: Mapping[str, Mapping[str, Any] | pb.Versions]) -> str:
    """Every host's versions of ``SLICE_FIELDS``, one line each."""
    rows = [["HOST", *(f.upper() for f in SLICE_FIELDS)]]
    rows += [[name, *(_as_dict(v)[f] or "-" for f in SLICE_FIELDS)]
             for name, v in hosts.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

