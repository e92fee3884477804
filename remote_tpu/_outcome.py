"""A job's final event -> the value, or the exception the caller sees."""

from __future__ import annotations

from collections.abc import Sequence

from ._exceptions import JobFailedError, JobTimeoutError, RemoteError, RemoteTraceback
from ._proto import remote_tpu_pb2 as pb
from ._remote_exception import rebuild_exception

_STATE_WORDS = {
    pb.HOST_STATE_PENDING: "never started",
    pb.HOST_STATE_RUNNING: "still running",
    pb.HOST_STATE_SUCCEEDED: "succeeded",
    pb.HOST_STATE_FAILED: "failed",
    pb.HOST_STATE_DIED: "died",
    pb.HOST_STATE_CANCELLED: "cancelled",
    pb.HOST_STATE_LOST: "lost",
}


def describe_hosts(reports: Sequence[pb.HostReport]) -> str:
    lines = []
    for r in reports:
        words = _STATE_WORDS.get(r.state, "unknown")
        detail = f" ({r.detail})" if r.detail else ""
        lines.append(f"  host {r.host}: {words}{detail}")
    return "\n".join(lines)


def _last_lines(report: pb.HostReport) -> str:
    if not report.last_lines:
        return "  (no output)"
    return "\n".join(f"  | {line}" for line in report.last_lines)


def raise_for_end(end: pb.JobEnd, *, accelerator: str, job_id: str) -> None:
    """Return if the job succeeded, else raise what the caller should see."""
    if end.state == pb.JOB_STATE_SUCCEEDED:
        return
    hosts = describe_hosts(end.hosts)
    where = f"{accelerator}, job {job_id}"
    if end.state == pb.JOB_STATE_TIMED_OUT:
        stacks = "".join(f"\n===== host {r.host} =====\n{r.stacks.rstrip()}\n"
                         for r in end.hosts if r.stacks)
        raise JobTimeoutError(f"job {job_id} on {accelerator} {end.detail}; every host was "
                              f"stopped. Final state of each host:\n{hosts}"
                              + (f"\nWhere each host was at the timeout:{stacks}"
                                 if stacks else ""), hosts=end.hosts)
    if end.state == pb.JOB_STATE_PREEMPTED:
        raise JobFailedError(f"job {job_id} on {accelerator} ended: {end.detail}. Final state "
                             f"of each host:\n{hosts}", host=end.root_cause_host,
                             hosts=end.hosts)
    if end.state == pb.JOB_STATE_LOST:
        raise JobFailedError(f"job {job_id} on {accelerator} was lost: {end.detail}",
                             hosts=end.hosts)
    if end.state == pb.JOB_STATE_CANCELLED:
        raise JobFailedError(f"job {job_id} on {accelerator} was cancelled: "
                             f"{end.detail or 'no reason given'}. Final state of each "
                             f"host:\n{hosts}", hosts=end.hosts)
    if end.root_cause_host < 0 or end.root_cause_host >= len(end.hosts):
        detail = end.detail or "no host reported a cause"
        raise JobFailedError(f"job {job_id} on {accelerator} failed: {detail}. Final state "
                             f"of each host:\n{hosts}", hosts=end.hosts)
    h = end.root_cause_host
    root = end.hosts[h]
    n = len(end.hosts)
    if root.state == pb.HOST_STATE_FAILED and root.exception.type_name:
        info = root.exception
        cause = RemoteTraceback(f"\nTraceback on host {h} of {n} ({where}):\n"
                                f"{info.traceback.rstrip()}")
        exc = rebuild_exception(info.pickled)
        if isinstance(exc, Exception):
            try:
                exc.add_note(f"raised on host {h} of {n} ({where}). Final state of each "
                             f"host:\n{hosts}" + (f"\n{end.detail}" if end.detail else ""))
                exc.remote_host = h  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            raise exc from cause
        raise RemoteError(
            f"host {h} of {n} raised {info.type_name}: {info.message} (the exception "
            f"could not be rebuilt here; its traceback is below). Final state of each "
            f"host:\n{hosts}",
            type_name=info.type_name, remote_traceback=info.traceback, host=h) from cause
    also = f" The agent adds: {end.detail}." if end.detail else ""
    raise JobFailedError(
        f"host {h} of {n} ({where}) {root.detail or _STATE_WORDS.get(root.state, 'failed')}."
        f"{also} Final state of each host:\n{hosts}\nLast output of host {h}:\n"
        f"{_last_lines(root)}", host=h, hosts=end.hosts)
