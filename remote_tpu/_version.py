"""Versions this side of the wire speaks."""

from __future__ import annotations

import functools
import importlib.metadata
import platform

__version__ = "0.1.0"

# Bump on any wire change an older peer could misread.
PROTOCOL_VERSION = 3


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
