"""A job's story, from its record (``remote-tpu jobs show JOB``): queued, each
attempt, each host's worker started, ``jax.distributed`` up, first output,
stalls, the first failure and its host, each host's end, the job's end; each
line with its local time and the seconds since the job was queued, in time
order. Times are the gateway's clock, one for every host."""

from __future__ import annotations

import time

from ._core.proto import remote_tpu_pb2 as pb
from ._core.states import HOST_STATE_WORDS, phase_name

_STATE_NAMES = {v: k.removeprefix("JOB_STATE_") for k, v in pb.JobState.items()}


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _events(status: pb.JobStatus) -> list[tuple[float, str]]:
    events = [(status.created_at, "queued (its function and arguments had arrived)")]
    for a in status.attempts:
        if a.started_at:
            events.append((a.started_at, f"attempt {a.number} started"))
        if a.ended_at:
            how = f", tried again ({a.kind})" if a.kind else ""
            where = f" on host {a.root_cause_host}" if a.root_cause_host >= 0 else ""
            events.append((a.ended_at, f"attempt {a.number} ended "
                                       f"{_STATE_NAMES.get(a.state, '?')}{where}{how}: "
                                       f"{_one_line(a.cause)}"))
    if status.started_at:
        attempt = f" (attempt {len(status.attempts)})" if status.attempts else ""
        events.append((status.started_at, f"running{attempt}"))
    end = status.end if status.HasField("end") else None
    reports = {r.host: r for r in end.hosts} if end is not None else {}
    for times in end.timeline if end is not None else []:
        h = times.host
        if times.worker_started_at:
            events.append((times.worker_started_at, f"host {h}: worker started"))
        if times.jax_ready_at:
            events.append((times.jax_ready_at, f"host {h}: jax.distributed initialized"))
        if times.first_output_at:
            events.append((times.first_output_at, f"host {h}: first output"))
        if times.ended_at:
            report = reports.get(h)
            word = HOST_STATE_WORDS.get(report.state, "ended") if report else "ended"
            cause = " (the first failure: the root cause)" if h == end.root_cause_host else ""
            what = f": {_one_line(report.detail)}" if report is not None and report.detail \
                and report.state != pb.HOST_STATE_SUCCEEDED else ""
            took = (f" after {times.ended_at - times.worker_started_at:.3f} s"
                    if times.worker_started_at else "")
            events.append((times.ended_at, f"host {h}: {word}{cause}{took}{what}"))
    for stall in status.stalls:
        odd = ", ".join(map(str, stall.odd_hosts))
        events.append((stall.at, f"stalled: no progress for {stall.quiet_seconds:.0f} s"
                                 + (f"; odd host(s) {odd}" if odd else "")))
    if status.ended_at:
        state = _STATE_NAMES.get(end.state, phase_name(status.phase)) if end is not None \
            else phase_name(status.phase)
        detail = f": {_one_line(end.detail)}" if end is not None and end.detail else ""
        events.append((status.ended_at, f"ended {state}{detail}"))
    return sorted((e for e in events if e[0]), key=lambda e: e[0])


def story(status: pb.JobStatus) -> str:
    """The job's timeline, one event a line."""
    start = status.created_at
    hosts = f"{status.num_hosts} host{'s' if status.num_hosts != 1 else ''}"
    lines = [f"job {status.job_id} ({status.accelerator}, {hosts}): "
             f"{phase_name(status.phase)}"]
    for when, what in _events(status):
        clock = time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when % 1 * 1000):03d}"
        lines.append(f"  {clock}  +{when - start:8.3f} s  {what}")
    first = min([a.started_at for a in status.attempts if a.started_at] +
                [status.started_at] if status.started_at else [0.0])
    if status.ended_at and first:
        lines.append(f"  queued for {first - status.created_at:.3f} s, ran for "
                     f"{status.ended_at - first:.3f} s"
                     + (f" ({len(status.attempts) + 1} attempts)" if status.attempts else ""))
    elif not status.ended_at:
        lines.append("  (still going: each host's steps are told once the job ends)")
    return "\n".join(lines) + "\n"
