"""Stalls: a job none of whose hosts made progress for ``stall_after`` seconds.

Progress is any host's output, a ``remote_tpu.progress()`` call, or a worker
using the CPU (``worker.progress``). The usual multi-host hang is one host
stuck (in data loading, a deadlock, a slow disk) while every other waits for
it in a collective: then nothing moves anywhere. ``StallWatch`` notices the
quiet; ``report`` groups every process's stacks, taken at once, by where the
thread that runs the function is, and names the hosts whose place differs
from the largest group's, with the frames where it differs. The job goes on
(``on_stall="report"``) or ends (``"cancel"``); a second report comes only
after progress was seen again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from remote_tpu._core.limits import cut_text
from remote_tpu._core.proto import remote_tpu_pb2 as pb

REPORT_CHARS = 16 * 1024     # a report's text, as the caller sees it
STALLS_KEPT = 8              # reports kept in a job's record: the first and the newest
SHOWN_FRAMES = 8             # innermost frames shown of each place


class StallWatch:
    """When the job last moved; ``every``: how often the job's loop looks
    (a second, or a quarter of ``after`` if shorter). ``starting``: processes
    whose worker has yet to start (a cold job's: the watch begins once all
    have, so that a peer preparing at length, an install say, while process
    0 waits in ``jax.distributed``, is no stall)."""

    def __init__(self, after: float, starting: int = 0) -> None:
        self.after = after
        self.every = min(1.0, max(after / 4, 0.05))
        self.last = time.monotonic()
        self.starting = starting
        self.reported = False          # this quiet spell's report is out (or on its way)
        self.quiet_since = 0.0         # when the spell being reported began

    def saw(self, event: object) -> None:
        """A host's event: output, a step, jax up or a busy worker is the job
        moving (a look at an idle worker is not); a worker started, too."""
        if not isinstance(event, pb.Event):
            return
        if event.HasField("started"):
            self.starting = max(0, self.starting - 1)
        elif not (event.HasField("output") or (
                event.HasField("progress") and (event.progress.busy or event.progress.has_step
                                                or event.progress.jax_ready))):
            return
        self.last = time.monotonic()
        self.reported = False

    def due(self) -> float | None:
        """The quiet so far, once it reached ``after`` (once per spell)."""
        quiet = time.monotonic() - self.last
        if self.starting or self.reported or quiet < self.after:
            return None
        self.reported, self.quiet_since = True, self.last
        return quiet

    def moved_since(self, since: float) -> bool:
        """Whether the job moved after ``since`` (a report taken meanwhile is stale)."""
        return self.last > since


def _main_frames(text: str) -> tuple[str, ...]:
    """The frames (innermost first, as faulthandler writes them) of the
    worker's main thread, which runs the function: the thread that starts in
    runpy (the worker is ``python -m``), else the last one listed with a
    module's top level (faulthandler lists the newest thread first); the
    whole text where there is none."""
    threads: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif line.startswith("  File ") and threads:
            threads[-1].append(line.strip())
    for frames in threads:
        if frames and frames[-1].endswith(" in _run_module_as_main"):
            return tuple(frames)
    for frames in reversed(threads):
        if any(f.endswith(" in <module>") for f in frames):
            return tuple(frames)
    return tuple(threads[-1]) if threads else (text.strip(),)


def _names(hosts: Sequence[int]) -> str:
    return ("host " if len(hosts) == 1 else "hosts ") + ", ".join(map(str, hosts))


def _shown(frames: Sequence[str], indent: str = "    ") -> list[str]:
    """The innermost frames and the outermost ones (where a stack parts from
    another's: the user's own lines, the library call they made), with how
    many lie between."""
    if len(frames) <= SHOWN_FRAMES:
        return [indent + f for f in frames]
    half = SHOWN_FRAMES // 2
    return [indent + f for f in frames[:half]] + [
        f"{indent}... {len(frames) - 2 * half} frames"] + [indent + f for f in frames[-half:]]


def _where_it_differs(odd: tuple[str, ...], usual: tuple[str, ...]
                      ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each stack's frames from the outermost one where they part (innermost first)."""
    a, b = odd[::-1], usual[::-1]
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return a[same:][::-1], b[same:][::-1]


def report(job_id: str, quiet: float, stacks: Sequence[pb.HostStacks],
           cancel: bool) -> pb.StallReport:
    """The stall report of ``job_id``, from every process's stacks."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for s in stacks:
        groups.setdefault(_main_frames(s.text), []).append(s.host)
    ranked = sorted(groups.items(), key=lambda g: (-len(g[1]), g[1]))
    usual = ranked[0] if len(ranked) == 1 or len(ranked[0][1]) > len(ranked[1][1]) else None
    odd = sorted(h for frames, hosts in ranked if usual is None or frames != usual[0]
                 for h in hosts) if usual is not None else []
    lines = [f"job {job_id} stalled: no host made progress for {quiet:.0f} s (no output, no "
             "remote_tpu.progress(), no CPU use by any worker); every process's stack, "
             "taken at once:"]
    if len(stacks) == 1:
        lines.append(f"{_names(ranked[0][1])} is at:")
        lines += _shown(ranked[0][0])
    elif len(ranked) == 1:
        lines.append(f"every host is at the same place ({_names(ranked[0][1])}):")
        lines += _shown(ranked[0][0])
    elif usual is None:
        lines.append("the hosts are at different places, none in a larger group:")
        for frames, hosts in ranked:
            lines.append(f"  {_names(hosts)}:")
            lines += _shown(frames)
    else:
        for frames, hosts in ranked[1:]:
            theirs, ours = _where_it_differs(frames, usual[0])
            lines.append(f"{_names(hosts)} {'differs' if len(hosts) == 1 else 'differ'} "
                         f"from the other {len(usual[1])} ({_names(usual[1])}); "
                         f"{'it is' if len(hosts) == 1 else 'they are'} at:")
            lines += _shown(theirs or frames)
            lines.append(f"  where {_names(usual[1])} {'is' if len(usual[1]) == 1 else 'are'} "
                         "at:")
            lines += _shown(ours or usual[0])
    lines.append("on_stall='cancel': the job is stopped." if cancel else
                 "The job goes on (on_stall='cancel' would stop it); "
                 "`remote-tpu jobs stalls JOB` shows this again.")
    return pb.StallReport(at=time.time(), quiet_seconds=quiet, odd_hosts=odd,
                          text=cut_text("\n".join(lines), REPORT_CHARS), cancelled=cancel)


def stalled_end(stall: pb.StallReport, stacks: Sequence[pb.HostStacks],
                reports: list[pb.HostReport], lost: str = "") -> pb.JobEnd:
    """on_stall="cancel"'s end, once every host was stopped: the job failed,
    its root cause the first host whose stack differed from the others'
    (none where no host stood out), every host's stacks in its report;
    ``lost``: what became of a warm session, said after it."""
    for s in stacks:
        if s.host < len(reports):
            reports[s.host].stacks = s.text
    cause = stall.odd_hosts[0] if stall.odd_hosts else -1
    detail = (f"stalled: no host made progress for {stall.quiet_seconds:.0f} s "
              "(stall_after=; on_stall='cancel' stopped every host)")
    if cause >= 0:
        reports[cause].state = pb.HOST_STATE_FAILED
        reports[cause].detail = ("stalled here: its stack differed from the other hosts' "
                                 "(the stall report says where)")
    if lost:
        detail = f"{detail}; {lost}"
    return pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=cause, hosts=reports,
                     detail=detail)
