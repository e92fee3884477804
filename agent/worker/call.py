"""One call as a worker gets it, and its outcome as the agent reads it back."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from remote_tpu._core.limits import valid_text
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker import frames as wire


@dataclasses.dataclass
class Call:
    """job_dir: where the call's files go (a large value, the whole traceback);
    env: the worker's environment for it; payload: the pickled function and
    arguments, inline (bytes) or the path of a file (and the files of its
    large buffers, sent apart: ``host.blobs``); digest: the payload's
    digest (hex), which the worker checks before unpickling."""

    job_dir: str
    env: Mapping[str, str]
    payload: bytes | str
    digest: str
    blobs: list[str] = dataclasses.field(default_factory=list)   # its large buffers' files
    result_dir: str = ""      # where a large value goes ("" = job_dir)
    working_dir: str = ""     # working_dir=: the call's cwd, on sys.path ("" = none)
    data: dict[str, str] = dataclasses.field(default_factory=dict)   # Data trees: digest -> copy
    gcs_data: list[str] = dataclasses.field(default_factory=list)    # gs:// Data to fetch
    stall_after: float = 0.0  # stall_after=: the worker's CPU is watched (worker.progress)

    def send(self, fd: int, env_changes: Mapping[str, str], warm: bool) -> None:
        """Write the call to a worker's control pipe (``warm``: the worker stays,
        for the next call, once it has returned)."""
        inline = isinstance(self.payload, bytes)
        wire.write_frame(fd, wire.CALL, {
            "job_dir": self.job_dir, "env": dict(env_changes), "digest": self.digest,
            "blobs": self.blobs, "result_dir": self.result_dir,
            "payload_path": "" if inline else self.payload, "warm": warm,
            "working_dir": self.working_dir, "data": self.data, "gcs_data": self.gcs_data,
        }, self.payload if inline else b"")


def apply_outcome(report: pb.HostReport, outcome: dict) -> None:
    """A worker's outcome (its DONE frame's header) into the host's report."""
    if outcome.get("state") == "succeeded":
        report.state = pb.HOST_STATE_SUCCEEDED
        report.detail = "returned"
        return
    exc = outcome.get("exception", {})
    report.state = pb.HOST_STATE_FAILED
    report.finished_at = float(outcome.get("failed_at", time.time()))
    report.detail = f"raised {exc.get('type_name', '?')} while {outcome.get('phase', 'running')}"
    report.exception.CopyFrom(pb.RemoteException(
        type_name=valid_text(exc.get("type_name", "")),
        message=valid_text(exc.get("message", "")),
        traceback=valid_text(exc.get("traceback", "")),
        pickled=bytes.fromhex(exc.get("pickled", "")),
    ))


def unreadable(exc: BaseException) -> dict:
    """The outcome of a worker whose own outcome could not be read."""
    return {"state": "failed", "phase": "reporting", "exception": {
        "type_name": type(exc).__name__, "message": f"unreadable outcome: {exc!r}",
        "traceback": "", "pickled": ""}}
