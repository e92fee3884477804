"""The one vocabulary of job and host states.

A job's phase (``JobPhase``, in its status) goes QUEUED -> RUNNING -> one of the
finished phases. Its final report (``JobEnd.state``, a ``JobState``) names the
same finished states, under the same names. Each host of a job is in one
``HostState``. Users see phases by name: ``"TIMED_OUT"``, not ``JOB_PHASE_TIMED_OUT``.
"""

from __future__ import annotations

from .proto import remote_tpu_pb2 as pb


def phase_name(phase: int) -> str:
    """``pb.JOB_PHASE_TIMED_OUT`` -> ``"TIMED_OUT"``."""
    return pb.JobPhase.Name(phase).removeprefix("JOB_PHASE_")


FINISHED = frozenset(v for v in pb.JobPhase.values()
                     if v not in (pb.JOB_PHASE_UNSPECIFIED, pb.JOB_PHASE_QUEUED,
                                  pb.JOB_PHASE_RUNNING))
FINISHED_NAMES = frozenset(phase_name(v) for v in FINISHED)

# A final report's state -> the job's phase of the same name.
PHASE_OF_END = {v: pb.JobPhase.Value(pb.JobState.Name(v).replace("JOB_STATE_", "JOB_PHASE_"))
                for v in pb.JobState.values() if v}

# How one host's worker ended -> the phase of that host's own record (a peer's).
_PHASE_OF_HOST = {
    pb.HOST_STATE_SUCCEEDED: pb.JOB_PHASE_SUCCEEDED,
    pb.HOST_STATE_FAILED: pb.JOB_PHASE_FAILED,
    pb.HOST_STATE_DIED: pb.JOB_PHASE_FAILED,
    pb.HOST_STATE_CANCELLED: pb.JOB_PHASE_CANCELLED,
}


def phase_of_host(state: int) -> int:
    return _PHASE_OF_HOST.get(state, pb.JOB_PHASE_FAILED)


# A host's state in words, as the caller's error lists every host.
HOST_STATE_WORDS = {
    pb.HOST_STATE_PENDING: "never started",
    pb.HOST_STATE_RUNNING: "still running",
    pb.HOST_STATE_SUCCEEDED: "succeeded",
    pb.HOST_STATE_FAILED: "failed",
    pb.HOST_STATE_DIED: "died",
    pb.HOST_STATE_CANCELLED: "cancelled",
    pb.HOST_STATE_LOST: "lost",
}


# retries=: how a job's end counts (the client's loop and the gateway's agree).
PREEMPTION, FAILURE = "preemption", "failure"


def retry_kind(end: pb.JobEnd) -> str:
    """PREEMPTION (a host preempted, vanished or restarted under the job),
    FAILURE (the function raised, a worker died, the job timed out), or ""
    for an end that is never retried (it succeeded, was cancelled, or
    nothing ran and asking again cannot help: ``permanent``)."""
    if end.permanent:
        return ""
    if end.state in (pb.JOB_STATE_PREEMPTED, pb.JOB_STATE_LOST):
        return PREEMPTION
    if end.state in (pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED,
                     pb.JOB_STATE_UNSPECIFIED):
        return ""
    if 0 <= end.root_cause_host < len(end.hosts) and \
            end.hosts[end.root_cause_host].state == pb.HOST_STATE_LOST:
        return PREEMPTION
    return FAILURE


def end_cause(end: pb.JobEnd) -> str:
    """Why a job ended, in one line (at most 300 characters)."""
    h = end.root_cause_host
    if end.state == pb.JOB_STATE_PREEMPTED and end.detail:
        text = end.detail.split(";")[0]           # "host 1 was preempted (...)"
    elif 0 <= h < len(end.hosts):
        r = end.hosts[h]
        if r.exception.type_name:
            text = f"host {h} raised {r.exception.type_name}: {r.exception.message}"
        else:
            text = f"host {h} {r.detail or HOST_STATE_WORDS.get(r.state, 'failed')}"
    else:
        text = f"{phase_name(PHASE_OF_END.get(end.state, pb.JOB_PHASE_FAILED))}: " \
               f"{end.detail or 'no cause given'}"
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:300]
