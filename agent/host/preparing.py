"""Preparing a host's part of a job, as the job's first step: its
requirements= installed, the client's interpreter set up, its trees placed
(``GatewayRole._prepare``, ``PeerCall._prepare``). It runs in a thread of its
own, its processes as the job's ``Children``, while the job's thread takes
the job's events: a cancel, the job's timeout or the caller going away ends
the job there and then, the installer's process group killed, and the slice's
next job can start. What preparing says reaches the job's output as it comes."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Generator, Sequence

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker.call import Call
from remote_tpu_agent.jobs.events import EventQueue
from remote_tpu_agent.worker.processes import Children, Stopped

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """The gateway's own processes of a job, made ready: each one's
    environment, and the call's buffers' files and trees on this host."""

    envs: list[dict[str, str]]
    blob_paths: Sequence[str] = ()
    working_dir: str = ""
    data: dict[str, str] = dataclasses.field(default_factory=dict)


class NotPrepared(Exception):
    """A host's part of a job cannot be made ready (its requirements do not
    install, its files cannot be written): the job fails with this message
    before anything runs."""


@dataclasses.dataclass
class _Said:
    """(On the job's events queue.) A line preparing said (an installer's)."""

    line: str


@dataclasses.dataclass
class _Made:
    """(On the job's events queue.) Preparing is over: what it made, or why not."""

    made: object
    error: BaseException | None = None


def _start(make: Callable[[], object], events: EventQueue) -> None:
    """Run ``make`` in a thread of its own; its outcome goes on ``events``."""
    def run() -> None:
        try:
            events.put(_Made(make()))
        except (NotPrepared, Stopped) as exc:
            events.put(_Made(None, exc))
        except Exception as exc:  # noqa: BLE001 - the job fails, the agent goes on
            log.exception("preparing a job failed")
            events.put(_Made(None, NotPrepared(
                f"internal error in the agent while preparing the job: {exc}")))
    threading.Thread(target=run, daemon=True, name="prepare").start()


def prepare_or_end(prepare: Callable[[Children], Prepared], children: Children,
                   events: EventQueue, ending: Callable[[object], tuple[int, str] | None]
                   ) -> Prepared | pb.JobEnd:
    """(The gateway.) What ``prepare`` made; or the job's end: why it could
    not be made, or what ``ending`` makes of an event that came meanwhile (a
    cancel, the timeout: ``(state, why)``), ``children`` then stopped."""
    _start(lambda: prepare(children), events)
    while True:
        item = events.get()
        if isinstance(item, _Made):
            return item.made or pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=0,
                                          detail=str(item.error), permanent=True)
        end = ending(item)
        if end is not None:
            children.stop(end[1])
            return pb.JobEnd(state=end[0], root_cause_host=-1, detail=(
                f"{end[1]}, while host 0 prepared the job (before any worker started)"))


def prepare_saying(make: Callable[[Callable[[str], None]], Call], children: Children,
                   events: EventQueue, said: Callable[[str], pb.Event]
                   ) -> Generator[pb.Event, None, Call | BaseException | None]:
    """(A peer.) ``make(say)`` in a thread of its own, while this one yields
    each line it says (``said`` makes it an event) as it comes. Returns the
    call, or what ``make`` raised (NotPrepared, Stopped); None at once when
    ``events`` gives None (the gateway's call ended: ``children`` stopped)."""
    _start(lambda: make(lambda line: events.put(_Said(line))), events)
    while True:
        item = events.get()
        if item is None:
            children.stop("the gateway's call ended")
            return None
        if isinstance(item, _Said):
            yield said(item.line)
        elif isinstance(item, _Made):
            return item.error or item.made


def local_calls(prepared: Prepared, spec: pb.JobSpec, job_dir: str, payload: bytes | str,
                results_dir: str) -> list[Call]:
    """The calls of the gateway's own processes: process 0 (the coordinator)
    works in ``job_dir`` itself and puts its value in ``results_dir``."""
    calls = []
    for k, env in enumerate(prepared.envs):
        directory = job_dir if k == 0 else os.path.join(job_dir, f"process-{k}")
        if k:
            os.makedirs(directory, exist_ok=True)
        calls.append(Call(job_dir=directory, env=env, payload=payload,
                          digest=spec.payload_digest.hex(), blobs=list(prepared.blob_paths),
                          working_dir=prepared.working_dir, data=prepared.data,
                          gcs_data=list(spec.gcs_data), result_dir="" if k else results_dir,
                          stall_after=spec.stall_after_seconds))
    return calls
