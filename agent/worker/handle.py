"""The one contract the gateway drives every process of a job through
(``ProcessHandle``): a worker of its own (``worker.run.WorkerRun``) and a
process on a peer host (``gateway.peer_process.RemoteHost``) alike, so that
a job's cancel, stacks, release and end treat them as one list."""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class ProcessHandle(Protocol):
    """One process of a job, here or on a peer, as the gateway sees it.

    ``host``: the process's index in the job; ``parked``: a warm process
    between calls, whose call stays open; ``finished``: set once the call's
    ``exited`` event has been emitted. Handing a warm process its next call
    (``next_call``) differs between the two (a prepared ``Call`` here, the
    spec and payload for a peer), so it is not part of the contract."""

    host: int
    parked: bool
    finished: threading.Event

    def start(self) -> None:
        """Start the process's call; its events go to the emit it was made with."""

    def stacks(self) -> str:
        """Every thread's Python stack in the process, as text (never raises)."""

    def release(self) -> None:
        """The job's value is safe: the process may exit (a no-op when parked)."""

    def cancel(self) -> None:
        """Stop the process's call (its process group, here or on the peer)."""

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the function the process runs (a no-op
        between calls)."""

    def pickled_value(self) -> bytes | str | None:
        """Its function's pickled value (all_results=: every process's), inline
        or the path of its file; None when none came."""

    def close(self) -> None:
        """The call is over: nothing of it survives, but a parked process."""

    def stop(self) -> None:
        """End the process, parked or not."""
