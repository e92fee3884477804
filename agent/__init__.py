"""remote_tpu_agent: the daemon that runs on every host of a slice.

Installed from the ``agent/`` source directory under the name
``remote_tpu_agent`` so it cannot collide with anything in a user's environment.

Its plan, top down; a wing imports only the wings below it (``tests/unit/test_layout.py``
checks it), and reaches ``remote_tpu`` only through ``remote_tpu._core``:

- ``server``: the command, the gRPC servicer, the token guard;
- ``gateway``: a job across the slice, its queue, warm sessions, root cause;
- ``peer``: this host's part of a job some gateway runs;
- ``host``: what this host offers every job (settings, argument cache, trees,
  outputs, interpreters and environments, TPU locks);
- ``jobs``: job records, output logs, events, reading jobs back, request checks;
- ``worker``: the worker child process and running it;
- ``wire``: the data port, links and lanes beside gRPC, discovery.
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
