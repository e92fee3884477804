"""Who this agent is and who its peers are.

Today: explicit configuration (``--worker-id``, ``--peers``) or the host list a
client sends. The TPU metadata server and TPU environment variables come next.
"""

from __future__ import annotations

import dataclasses
import socket


@dataclasses.dataclass(frozen=True)
class Slice:
    worker_id: int = 0
    peers: tuple[str, ...] = ()   # every agent of the slice, index = worker id


def advertise_address(bind_host: str, explicit: str = "") -> str:
    """The address peers use to reach this host (the JAX coordinator's host)."""
    if explicit:
        return explicit
    if bind_host not in ("", "0.0.0.0", "::", "[::]"):
        return bind_host.strip("[]")
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
