"""`remote-tpu jobs list|status|logs|result|cancel|stacks`: the jobs a slice's
gateway keeps, from a shell. ``status`` is a key: value block for people
(``--json``: the JobStatus fields, for scripts); ``logs`` reads one host's log,
or every host's, each line prefixed with its host.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING

from ._core.addresses import HOSTS_ENV
from ._core.exceptions import ConfigurationError
from ._core.proto import remote_tpu_pb2 as pb
from ._option_checks import hosts_text
from ._render import LogPrinter

if TYPE_CHECKING:
    from ._jobs import JobHandle, JobStatus

RawHelp = argparse.RawDescriptionHelpFormatter

JOBS_HELP = "jobs on a slice: list, status, show, logs, result, cancel, stacks, stalls"
JOBS_EPILOG = """examples:
  remote-tpu jobs list --hosts 10.0.0.2
  remote-tpu jobs status train-3f2a9c0d1e2f
  remote-tpu jobs logs -f --host all train-3f2a9c0d1e2f"""

LOGS_ORDER = """

Times are the gateway's clock when it stored each output (to a tenth of a
second; one clock for every host, so no skew between them): --host all merges
the hosts' logs in that order, each host's lines in their own order; with -f,
what was written before comes host by host, then each line as it reaches the
gateway. --since takes a duration ago (90s, 10m, 2h, 1d) or a local time
(2026-11-27 14:05, or 14:05 today). A log of an older agent has no times: it
comes host by host, and --since keeps all of it."""

ACTIONS = {
    "list": ("the jobs the gateway knows, newest first (times are local)", """examples:
  remote-tpu jobs list --hosts 10.0.0.2
  REMOTE_TPU_HOSTS=10.0.0.2 remote-tpu jobs list | grep RUNNING"""),
    "status": ("one job's state, times and root cause (--json: for scripts)", """examples:
  remote-tpu jobs status train-3f2a9c0d1e2f --hosts 10.0.0.2
  remote-tpu jobs status --json train-3f2a9c0d1e2f | jq -r .state"""),
    "show": ("a job's story in time order: queued, each host's worker, jax, first output, "
             "stalls, failures, ends", """examples:
  remote-tpu jobs show train-3f2a9c0d1e2f --hosts 10.0.0.2
  remote-tpu jobs show nightly-0a1b2c3d4e5f | grep 'host 3'"""),
    "logs": ("a host's output, or every host's (--host all)", """examples:
  remote-tpu jobs logs train-3f2a9c0d1e2f                  the leader's (host 0) log
  remote-tpu jobs logs -f --tail 20 train-3f2a9c0d1e2f     its last 20 lines, then on
  remote-tpu jobs logs --host all --since 10m train-3f2a9c0d1e2f   merged, in time order"""),
    "result": ("the value process 0 returned (or the error), once it has ended",
               """examples:
  remote-tpu jobs result train-3f2a9c0d1e2f --hosts 10.0.0.2
  remote-tpu jobs result nightly-0a1b2c3d4e5f > value.txt"""),
    "cancel": ("stop a job on every host; prints the state it ended in", """examples:
  remote-tpu jobs cancel train-3f2a9c0d1e2f --hosts 10.0.0.2
  remote-tpu jobs cancel warm-0a1b2c3d4e5f          end a slice's warm workers"""),
    "stacks": ("every host's Python stacks, now: which host is stuck where", """examples:
  remote-tpu jobs stacks train-3f2a9c0d1e2f --hosts 10.0.0.2
  remote-tpu jobs stacks train-3f2a9c0d1e2f | less"""),
    "stalls": ("the job's stall reports: when no host moved, which host stood out and where",
               """examples:
  remote-tpu jobs stalls train-3f2a9c0d1e2f --hosts 10.0.0.2
  remote-tpu jobs stalls train-3f2a9c0d1e2f | less"""),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    j = sub.add_parser("jobs", help=JOBS_HELP + " (--hosts or REMOTE_TPU_HOSTS)",
                       description=JOBS_HELP + ", of the slice behind --hosts (or\n"
                       "$REMOTE_TPU_HOSTS), the token as for run", epilog=JOBS_EPILOG,
                       formatter_class=RawHelp)
    jsub = j.add_subparsers(dest="action", metavar="ACTION")
    for action, (text, epilog) in ACTIONS.items():
        a = jsub.add_parser(action, help=text, epilog=epilog, formatter_class=RawHelp,
                            description=text + (LOGS_ORDER if action == "logs" else ""))
        a.add_argument("--hosts", default="", help="the gateway's address (any agent of "
                                                   "the slice with worker 0 first; default "
                                                   "$REMOTE_TPU_HOSTS)")
        if action != "list":
            a.add_argument("job_id", help="the job's id, as `remote-tpu jobs list` shows it")
        if action == "status":
            a.add_argument("--json", action="store_true",
                           help="the JobStatus fields as JSON (times in Unix seconds)")
        if action == "logs":
            a.add_argument("-f", "--follow", action="store_true",
                           help="keep printing what the job writes until it ends")
            a.add_argument("--host", type=host_choice, default=None, metavar="I|all",
                           help="a host's index (default 0, the leader), or all: every "
                                "host's, each line prefixed [host I]")
            a.add_argument("--tail", type=line_count, default=None, metavar="N",
                           help="only the last N lines of each host's log (with -f: "
                                "then what comes)")
            a.add_argument("--grep", type=grep_pattern, default=None, metavar="REGEX",
                           help="only the lines that match this Python regular expression "
                                "(after --since; --tail counts lines before it)")
            a.add_argument("--since", type=since_time, default=0.0, metavar="WHEN",
                           help="only what the job wrote from then on: a duration ago "
                                "(90s, 10m, 2h, 1d) or a local time (14:05, "
                                "2026-11-27 14:05)")
    j.set_defaults(func=run, jobs_parser=j)


def host_choice(text: str) -> int | str:
    """``--host``: a host index, or "all"."""
    if text.strip().lower() == "all":
        return "all"
    try:
        host = int(text)
    except ValueError:
        host = -1
    if host < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a host: give a host's index "
                                         "(0, 1, ...) or all")
    return host


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_time(text: str, now: float | None = None) -> float:
    """``--since``: a duration ago (``90s``, ``10m``, ``2h``, ``1d``) or a
    local time (``14:05`` today, ``2026-11-27 14:05``, ISO 8601), as seconds
    since the epoch."""
    import datetime

    now = time.time() if now is None else now
    t = text.strip().lower()
    if t[-1:] in _UNITS and t[:-1].replace(".", "", 1).isdigit():
        return now - float(t[:-1]) * _UNITS[t[-1]]
    try:
        if len(t) <= 8 and ":" in t:           # a time of day, today
            clock = datetime.time.fromisoformat(t)
            day = datetime.datetime.fromtimestamp(now).date()
            return datetime.datetime.combine(day, clock).timestamp()
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a time: give a duration ago (90s, 10m, 2h, 1d) or a local time "
        "(14:05, or 2026-11-27 14:05)")


MAX_TAIL = 10_000_000      # lines of --tail: more is every line, said so


def line_count(text: str) -> int:
    """``--tail``: a number of lines, 0 (with ``-f``: new lines only) or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_TAIL:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of lines: give 0 to {MAX_TAIL:,}, e.g. --tail 100 "
            "(every line: leave --tail out; only new ones: --tail 0 -f)")
    return n


def run(args: argparse.Namespace) -> int:
    from ._jobs import attach, jobs

    if args.action is None:
        args.jobs_parser.error(f"give what to do: {', '.join(ACTIONS)} (`remote-tpu jobs "
                               "--help` says what each does)")
    if not args.hosts.strip() and not os.environ.get(HOSTS_ENV, "").strip():
        raise ConfigurationError(
            "which slice? give the address of its gateway (any agent of it) with --hosts, "
            f"e.g. --hosts 10.0.0.2, or set {HOSTS_ENV} (`remote-tpu local` prints one for "
            "a local slice)")
    hosts = hosts_text(args.hosts)
    if args.action == "list":
        print_list(jobs(hosts))
        return 0
    handle = attach(args.job_id, hosts)
    if args.action == "status":
        reply = handle._status_reply()
        if args.json:
            from ._jobs import JobStatus
            print(json.dumps(dataclasses.asdict(JobStatus.from_pb(reply)), indent=2))
        else:
            sys.stdout.write(status_block(reply, time.time()))
    elif args.action == "logs":
        print_logs(handle, args.host, args.tail, args.follow, sys.stdout, args.since,
                   args.grep)
    elif args.action == "result":               # ended as `remote-tpu run` ends a script
        from ._cli_run import script_status
        status, value = script_status(handle.result)
        if value is not None:
            print(repr(value))
        return status
    elif args.action == "cancel":
        print(handle.cancel().state)
    elif args.action == "stacks":
        for host, text in sorted(handle.stacks().items()):
            print(f"===== host {host} =====\n{text.rstrip()}\n")
    elif args.action == "show":
        from ._story import story
        sys.stdout.write(story(handle._status_reply()))
    elif args.action == "stalls":
        print_stalls(handle._status_reply())
    return 0


def print_stalls(status: pb.JobStatus) -> None:
    """Each stall report of the job, with its local time; or that there was none."""
    if not status.stalls:
        print(f"job {status.job_id}: no stall was seen (a stall: no host made progress for "
              "stall_after= seconds: 300 unless the call set another, or turned it off)")
        return
    for stall in status.stalls:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stall.at))
        print(f"===== {when} =====\n{stall.text.rstrip()}\n")


# ------------------------------------------------------------------ list and status

def local_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def duration(seconds: float) -> str:
    """``seconds`` for people: 0.4 s, 12.3 s, 5 min 3 s, 2 h 5 min, 3 d 4 h."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    hours, m = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {m} min"
    days, h = divmod(hours, 24)
    return f"{days} d {h} h"


def job_detail(j: JobStatus) -> str:
    """The DETAIL column of ``jobs list``: a queued job's place in the queue
    (nothing may be ahead of it: the slice is about to be its own)."""
    if j.state != "QUEUED":
        return j.detail
    place = f"behind {j.queued_behind}" if j.queued_behind else "next in line"
    if j.queue_position:
        place += f" (position {j.queue_position})"
    return f"{place}; {j.detail}" if j.detail else place


def print_list(rows: Sequence[JobStatus]) -> None:
    print(f"{'JOB':<44} {'STATE':<10} {'ACCELERATOR':<18} {'CREATED':<19} DETAIL")
    for j in rows:
        print(f"{j.id:<44} {j.state:<10} {j.accelerator:<18} {local_time(j.created_at):<19} "
              f"{job_detail(j)}")


def status_block(reply: pb.JobStatus, now: float) -> str:
    """A job's status as aligned ``key: value`` lines, times local."""
    from ._jobs import JobStatus

    s = JobStatus.from_pb(reply)
    rows = [("job", s.id), ("state", s.state), ("accelerator", s.accelerator),
            ("hosts", f"{s.hosts}" + (f" ({s.slices} slices)" if s.slices > 1 else "")),
            ("created", local_time(s.created_at))]
    if s.started_at is not None:
        rows.append(("started", f"{local_time(s.started_at)} "
                                f"(queued for {duration(s.started_at - s.created_at)})"))
    elif s.finished:
        rows.append(("started", "never"))
    else:
        rows.append(("started", f"not yet (queued for {duration(now - s.created_at)} so far)"))
    if s.ended_at is not None:
        ran = "" if s.started_at is None else f" (ran for {duration(s.ended_at - s.started_at)})"
        rows.append(("ended", local_time(s.ended_at) + ran))
    elif s.started_at is not None:
        rows.append(("ended", f"not yet (running for {duration(now - s.started_at)} so far)"))
    if s.warm_until is not None:
        rows.append(("warm until", f"{local_time(s.warm_until)} "
                                   f"(in {duration(s.warm_until - now)} unless called again)"))
    detail = job_detail(s)
    if detail:
        rows.append(("detail", detail))
    if reply.HasField("end") and reply.end.root_cause_host >= 0:
        rows.append(("root cause", root_cause(reply.end)))
    if s.attempts:
        rows.append(("attempts", f"{len(s.attempts)} before this one"))
        for a in s.attempts:
            when = "" if a.ended_at is None else f", ended {local_time(a.ended_at)}"
            where = "" if a.root_cause_host is None else f" on host {a.root_cause_host}"
            rows.append((f"  attempt {a.number}",
                         f"{a.state} ({a.kind}){where}{when}: {a.cause}"))
    width = max(len(key) for key, _ in rows) + 2
    lines = []
    for key, value in rows:
        first, *more = value.splitlines() or [""]
        lines.append(f"{key + ':':<{width}}{first}")
        lines += [" " * width + line for line in more]
    return "\n".join(lines) + "\n"


def root_cause(end: pb.JobEnd) -> str:
    """The host at the root of a failed job, and why, in one line."""
    host = end.root_cause_host
    for report in end.hosts:
        if report.host != host:
            continue
        error = report.exception
        why = (f"{error.type_name.rpartition('.')[2]}: {error.message}" if error.type_name
               else report.detail or (f"killed by {report.signal}" if report.signal else ""))
        first = why.strip().splitlines()[0] if why.strip() else ""
        return f"host {host} ({first})" if first else f"host {host}"
    return f"host {host}"


# ------------------------------------------------------------------ logs


def last_lines(handle: JobHandle, hosts: Sequence[int], n: int, since: float = 0.0
               ) -> tuple[dict[int, bytes], list[int]]:
    """The last ``n`` lines of each host's log as it is now (an unfinished
    last line counts as one; of what was stored from ``since``), and where
    each log ends: a follower goes on from there, nothing shown twice or
    missed."""
    lines = {h: collections.deque(maxlen=n) for h in hosts}
    held = dict.fromkeys(hosts, b"")
    ends = dict.fromkeys(hosts, 0)
    for host, data, offset, _ in handle._outputs(hosts, since=since):
        *done, held[host] = (held[host] + data).split(b"\n")
        lines[host].extend(line + b"\n" for line in done)
        ends[host] = offset
    tails = {}
    for h in hosts:
        kept = list(lines[h]) + ([held[h]] if held[h] else [])
        tails[h] = b"".join(kept[-n:] if n else [])
    return tails, [ends[h] for h in hosts]


def print_logs(handle: JobHandle, host: int | str | None, tail: int | None, follow: bool,
               out: IO[str], since: float = 0.0, grep: str | None = None) -> None:
    from . import _jobs

    status = handle.status()
    if host == "all":
        count = _jobs.log_count(handle, status.hosts)
        hosts = list(range(count))
        word = "host" if count == max(1, status.hosts) else "process"
        printer = LogPrinter(out, lambda h: f"[{word} {h}] ", keep=_matching(grep))
    else:
        hosts = [host or 0]
        if hosts[0] >= status.hosts:          # or one of its processes' logs?
            count = _jobs.log_count(handle, status.hosts)
            if hosts[0] >= count:
                raise ConfigurationError(no_such_host(handle.id, status.hosts, count, hosts[0]))
        printer = LogPrinter(out, None, keep=_matching(grep))
    offsets: list[int] = []
    if tail is not None:
        tails, offsets = last_lines(handle, hosts, tail, since)
        for h in hosts:
            printer.write(h, tails[h])
            if not follow:
                printer.end(h)
    if follow:
        for h, data, _, _ in handle._outputs(hosts, offsets, follow=True,
                                             since=0.0 if offsets else since):
            printer.write(h, data)
        for h in hosts:
            printer.end(h)
    elif tail is None:                   # every host's log merged in time order
        for h, data, _, _ in handle._outputs(hosts, merged=True, since=since):
            printer.write(h, data)
        for h in hosts:
            printer.end(h)

def _matching(grep: str | None) -> Callable[[str], bool] | None:
    """``--grep``: the lines it keeps (None: every one)."""
    if grep is None:
        return None
    import re
    pattern = re.compile(grep)
    return lambda line: pattern.search(line) is not None


def grep_pattern(text: str) -> str:
    """``--grep``: a Python regular expression, checked now."""
    import re
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {exc} "
                                         "(Python's re syntax, e.g. 'loss|step [0-9]+')") \
            from None
    return text


def no_such_host(job_id: str, hosts: int, count: int, host: int) -> str:
    """What ``--host host`` is told where the job has ``count`` logs."""
    hosts = max(1, hosts)
    has = (f"{hosts} host(s)" if count == hosts else
           f"{count} processes ({hosts} host(s) x {count // hosts}), one log each")
    return (f"job {job_id} has {has}: there is no --host {host}; give --host 0"
            + (f" to {count - 1}" if count > 1 else "") + ", or --host all")
