"""retries= of a submitted job, on its gateway: after an end its policy allows
(``_core.states.retry_kind``: a preemption, or a failure of the function), the
job runs again on every host, as attempt 1, 2, ... (``REMOTE_TPU_ATTEMPT``),
under the same job id: one record, one log (each retry said on host 0's
stderr), the attempts that ended listed in its status; when retries run out,
the last end is the job's, the earlier attempts' causes added to its detail.

Attempts wait ``backoff`` seconds, doubling up to ``backoff_max``, between
them; a job cancelled meanwhile ends at once. A gateway that is itself
preempted takes its retries with it: only a caller (an attached call's own
retries) can try again then.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from remote_tpu._core.limits import cut_text
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import PREEMPTION, end_cause, retry_kind

if TYPE_CHECKING:
    from remote_tpu_agent.jobs.record import JobRecord


def run_key(spec: pb.JobSpec) -> str:
    """What names one attempt of a job on a host: the job id, then ``.a1``,
    ``.a2``, ... for the attempts after the first (a peer's record, the
    restore of a job's trees)."""
    return spec.job_id if not spec.attempt else f"{spec.job_id}.a{spec.attempt}"


def next_attempt(record: JobRecord, end: pb.JobEnd) -> float | None:
    """Seconds to wait before the job runs again after ``end``, once this
    attempt is recorded and the retry said; None when the job ends here
    (``end`` then carries the earlier attempts' causes)."""
    spec = record.spec
    if not spec.HasField("retries"):
        return None
    kind = retry_kind(end)
    if kind:
        policy = spec.retries
        limit = policy.preemptions if kind == PREEMPTION else policy.failures
        used = sum(1 for a in record.status.attempts if a.kind == kind)
        if used < limit:
            attempt = pb.Attempt(number=spec.attempt, job_id=record.job_id, state=end.state,
                                 kind=kind, cause=end_cause(end),
                                 root_cause_host=end.root_cause_host,
                                 started_at=record.status.started_at, ended_at=time.time())
            delay = min(policy.backoff_max_seconds,
                        policy.backoff_seconds * 2 ** len(record.status.attempts))
            with record.changed:
                record.status.attempts.append(attempt)
                record.touch(wake=False)
            record.say(0, f"remote_tpu: attempt {spec.attempt} ended by a {kind} "
                          f"({attempt.cause}); attempt {spec.attempt + 1} starts in "
                          f"{delay:g} s ({used + 1} of {limit} {kind} retries)")
            return delay
    if record.status.attempts:
        earlier = cut_text("; ".join(f"attempt {a.number} ({a.kind}): {a.cause}"
                                     for a in record.status.attempts), 8000)
        spent = f"its {kind} retries were spent; " if kind else ""
        end.detail = (f"{end.detail}; " if end.detail else "") + \
            f"this was attempt {spec.attempt} ({spent}earlier attempts: {earlier})"
    return None
