"""Versions this side of the wire speaks, and the one rule of who can work with whom.

Client, agent (a job spec's client versions), gateway (each peer before a job),
``remote-tpu doctor`` and every unpickled envelope ask ``differences``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from collections.abc import Mapping
from typing import Any

from .exceptions import VersionMismatchError
from .proto import remote_tpu_pb2 as pb

__version__ = "0.1.0"

# Bump on any wire change an older peer could misread.
PROTOCOL_VERSION = 4
_FIELDS = ("protocol", "remote_tpu", "python", "cloudpickle", "jax")


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
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
    }


def versions_pb() -> pb.Versions:
    """This process's versions, as sent on the wire."""
    v = local_versions()
    return pb.Versions(protocol=int(v["protocol"]), remote_tpu=str(v["remote_tpu"]),
                       python=str(v["python"]), cloudpickle=str(v["cloudpickle"]),
                       jax=str(v["jax"]))


def differences(theirs: Mapping[str, Any] | pb.Versions, *, releases: bool = False
                ) -> list[str]:
    """What differs between ``theirs`` and this process that stops them working
    together: the wire protocol; the Python minor version and the cloudpickle
    release (cloudpickle ships code objects by value, which load only in the
    same Python minor version, and its format is stable only within a release).
    With ``releases``, also the remote_tpu and jax releases (which work together,
    but should not differ on one slice). Empty when nothing matters."""
    if isinstance(theirs, pb.Versions):
        theirs = {f: getattr(theirs, f) for f in _FIELDS}
    there = {f: str(theirs.get(f, "") or "?") for f in _FIELDS}
    here = {f: str(v) for f, v in local_versions().items()}
    problems = []
    if there["protocol"] != here["protocol"]:
        problems.append(f"protocol {there['protocol']} (remote_tpu {there['remote_tpu']}) "
                        f"there, protocol {here['protocol']} (remote_tpu "
                        f"{here['remote_tpu']}) here")
    if there["python"].split(".")[:2] != here["python"].split(".")[:2]:
        problems.append(f"Python {there['python']} there, {here['python']} here")
    if there["cloudpickle"] != here["cloudpickle"]:
        problems.append(f"cloudpickle {there['cloudpickle']} there, {here['cloudpickle']} here")
    if releases:
        for name in ("remote_tpu", "jax"):
            if here[name] and there[name] != here[name]:
                problems.append(f"{name} {there[name]} there, {here[name]} here")
    return problems


def check_compatible(theirs: Mapping[str, Any] | pb.Versions, *, sender: str) -> None:
    """Raise VersionMismatchError when ``differences`` finds any."""
    problems = differences(theirs)
    if problems:
        raise VersionMismatchError(
            f"{sender} cannot work with this process: " + "; ".join(problems)
            + ". Install the same remote_tpu release, Python minor version and cloudpickle "
            "release on the client and on every host.")
