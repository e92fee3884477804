"""remote_tpu_agent: the daemon that runs on every host of a slice.

Installed from the ``agent/`` source directory under the name
``remote_tpu_agent`` so it cannot collide with anything in a user's environment.
"""

from __future__ import annotations

from typing import Any

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:
    """``__version__``, read when asked (the worker imports this package, and
    should not pay for what it does not use)."""
    if name == "__version__":
        from remote_tpu._core.versions import __version__
        return __version__
    raise AttributeError(f"module 'remote_tpu_agent' has no attribute {name!r}")
