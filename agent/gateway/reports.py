"""Reports that gather every host's, bounded so that a reply always fits.

Each host's report is already cut where it is made (the worker cuts its
exception, the runner its stacks and last lines, see ``remote_tpu._core.limits``).
A job's final report gathers all of them: the root cause keeps all of its own,
the others are cut further when the whole would not fit, each cut saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

from remote_tpu._core.limits import DETAIL_CHARS, JOB_END_BYTES, LIST_REPLY_BYTES, cut_text
from remote_tpu._core.proto import remote_tpu_pb2 as pb

_LAST_LINES_KEPT = 5
_LINE_CHARS = 500


def _where(host: int, job_id: str) -> str:
    return (f"host {host}'s whole traceback is in exception.txt in job {job_id}'s "
            f"directory on that host; its output: handle.logs(host={host})")


def _shrink(report: pb.HostReport, job_id: str, share: int) -> None:
    """Cut one host's report to about ``share`` bytes (five texts, five lines)."""
    where = _where(report.host, job_id)
    each = max(300, share // 6)
    report.detail = cut_text(report.detail, min(DETAIL_CHARS, each))
    report.exception.message = cut_text(report.exception.message, each, where)
    report.exception.traceback = cut_text(report.exception.traceback, each, where)
    report.exception.pickled = b""           # the root cause's alone is rebuilt
    report.stacks = cut_text(report.stacks, each,
                             "the whole stacks were cut to fit the job's final report")
    line_chars = max(100, min(_LINE_CHARS, each // _LAST_LINES_KEPT))
    lines = [cut_text(line, line_chars) for line in report.last_lines[-_LAST_LINES_KEPT:]]
    report.last_lines[:] = lines


def bound_end(end: pb.JobEnd, job_id: str, budget: int = JOB_END_BYTES) -> pb.JobEnd:
    """A copy of ``end`` that fits in ``budget`` bytes (as near as the number of
    hosts allows: every host keeps at least its state and a short detail)."""
    bounded = pb.JobEnd()
    bounded.CopyFrom(end)
    bounded.detail = cut_text(bounded.detail, DETAIL_CHARS)
    if bounded.ByteSize() <= budget:
        return bounded
    root = bounded.root_cause_host
    others = [r for r in bounded.hosts if r.host != root]
    used = sum(r.ByteSize() for r in bounded.hosts if r.host == root)
    share = max(0, budget - used - 4096) // max(1, len(others))
    for report in others:
        _shrink(report, job_id, share)
    if bounded.ByteSize() > budget:           # thousands of hosts: states only
        for report in others:
            report.ClearField("exception")
            report.stacks = ""
            del report.last_lines[:]
            report.detail = cut_text(report.detail, 300)
    return bounded


def bound_stacks(stacks: Sequence[pb.HostStacks], budget: int = LIST_REPLY_BYTES
                 ) -> list[pb.HostStacks]:
    """Every host's stacks, each cut to an equal share when all would not fit."""
    out = list(stacks)
    total = sum(len(h.text) for h in out)
    if total <= budget:
        return out
    share = budget // max(1, len(out))
    return [pb.HostStacks(host=h.host, text=cut_text(
        h.text, share, f"{len(out)} hosts' stacks are cut to fit one reply")) for h in out]
