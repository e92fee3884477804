"""How a job ends, seen from its gateway (``JobEnding``): every host's report
as it comes, fail-fast's stop of every other host once one fails, the wait for
each host to confirm its end (a peer that does not is reported lost), and the
job's end with its root cause (``gateway.root_cause``)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from remote_tpu._core.limits import INTERRUPT_SECONDS
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.gateway.all_results import Joined, join
from remote_tpu_agent.gateway.peer_process import RemoteHost
from remote_tpu_agent.gateway.root_cause import root_cause
from remote_tpu_agent.gateway.stalls import stalled_end
from remote_tpu_agent.jobs.events import EventQueue
from remote_tpu_agent.worker.handle import ProcessHandle
from remote_tpu_agent.worker.run import WorkerRun

SETTLE_SECONDS = 4.0        # wait this long for every host's final report
# Fail-fast in a warm session: once a host raised, the others have this long to
# come back to rest (return or raise) for the session to go on; a host that
# does not (blocked in a collective for the one that failed, say) is stopped
# with every other, as in a cold job. Fail-fast stays within 2 s: this, then
# the stop (``WorkerRun.cancel``'s grace).
REST_SECONDS = 0.8
WARM_KEPT = ("the warm workers were kept: remote_tpu.state and what is on the devices "
             "are as the call left them")
WARM_LOST = ("the warm workers were stopped: remote_tpu.state and what was on the devices "
             "are gone, and the next call starts in fresh workers")


class JobEnding:
    """Every host's report of one job, and its end from them. ``locals`` and
    ``remotes``: the job's processes here and on its peers (the job's own
    lists, filled as it starts them); ``warm_call``: a warm session's call,
    whose failure ends the session; ``session``: the job keeps (or goes on) a
    warm session."""

    def __init__(self, *, spec: pb.JobSpec, n: int, events: EventQueue,
                 locals_: list[WorkerRun], remotes: list[RemoteHost], warm_call: bool,
                 session: bool, preempted: Callable[[], bool],
                 ending_of: Callable[[object], tuple[int, str] | None] = lambda item: None,
                 job_dir: str = "") -> None:
        self.spec = spec
        self.n = n
        self.events = events
        self.locals = locals_
        self.remotes = remotes
        self._warm_call = warm_call
        self._session = session
        self._preempted = preempted
        self.reports = [pb.HostReport(host=i, state=pb.HOST_STATE_PENDING) for i in range(n)]
        self.done: set[int] = set()
        self.exited: set[int] = set()
        self.warm_kept = False           # every host parked: the session goes on
        self._job_dir = job_dir
        self.joined: Joined | None = None    # all_results=: every process's value
        # (state, why) of a cancel or timeout that came while waiting for hosts
        self._ending_of = ending_of
        self.stopped: tuple[int, str] | None = None
        self.interrupted_at: float | None = None     # the caller's first Ctrl-C

    @property
    def handles(self) -> list[ProcessHandle]:
        return [*self.locals, *self.remotes]

    @property
    def local(self) -> WorkerRun:
        """Process 0: its value is the job's."""
        return self.locals[0]

    def record_exit(self, event: pb.Event) -> None:
        report = event.exited
        previous = self.reports[event.host]
        if event.host < len(self.locals) and report.state in (pb.HOST_STATE_DIED,
                                                              pb.HOST_STATE_LOST):
            report.preempted = self._preempted()
        if previous.state in (pb.HOST_STATE_SUCCEEDED, pb.HOST_STATE_FAILED) and \
                report.state == pb.HOST_STATE_LOST:
            # Its function had finished; only the goodbye went missing.
            previous.detail += f"; then {report.detail}"
            report = previous
        if previous.stacks and not report.stacks:
            report.stacks = previous.stacks
        if previous.notices and not report.notices:
            report.notices.extend(previous.notices)
        report.preempted = report.preempted or previous.preempted
        self.reports[event.host] = report
        self.exited.add(event.host)

    def settle(self, forward: bool, seconds: float = SETTLE_SECONDS) -> Iterator[pb.Event]:
        """Take events until every host has exited or ``seconds`` have passed;
        a peer that has not confirmed by then is reported lost."""
        yield from self.take_until(set(range(self.n)), seconds, forward)
        for h in self.remotes:
            if h.host not in self.exited:
                detail = f"agent at {h.address} did not confirm the worker stopped"
                h.abandon(detail)
                self.record_exit(pb.Event(host=h.host, exited=pb.HostReport(
                    host=h.host, state=pb.HOST_STATE_LOST, detail=detail,
                    finished_at=time.time())))

    def stop_all(self) -> None:
        for h in self.handles:
            if h.host not in self.exited:
                threading.Thread(target=h.cancel, daemon=True).start()

    def succeed(self) -> Iterator[pb.Event]:
        # Peers go first; process 0 keeps JAX's coordination service up until last.
        others = [*self.remotes, *self.locals[1:]]
        for handle in others:
            handle.release()
        yield from self.settle_hosts(others)
        self.local.release()
        yield from self.settle_hosts([self.local])
        lost = [r for r in self.reports if r.state != pb.HOST_STATE_SUCCEEDED]
        if lost and self._all_parked():       # (keep_going: some raised)
            yield self._failed_at_rest()
            return
        if lost:
            yield from self.fail(pb.JOB_STATE_FAILED)
            return
        digest = self.local.result_digest
        if self.spec.all_results:
            joined = join(self.handles, self._job_dir)
            if isinstance(joined, str):
                yield from self.fail(pb.JOB_STATE_FAILED, joined)
                return
            self.joined, digest = joined, joined.digest
        self.warm_kept = self._session and all(r.warm for r in self.reports)
        yield pb.Event(host=0, end=pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED, root_cause_host=-1,
                                             hosts=self.reports, result_digest=digest))

    def settle_hosts(self, handles: Sequence[ProcessHandle]) -> Iterator[pb.Event]:
        """Wait for these released hosts to exit; stop those that do not."""
        wanted = {h.host for h in handles}
        yield from self.take_until(wanted, SETTLE_SECONDS, forward=True)
        for h in handles:
            if h.host not in self.exited:
                if isinstance(h, RemoteHost):
                    h.abandon(f"agent at {h.address} did not confirm the worker exited")
                else:
                    h.cancel()
        yield from self.take_until(wanted, SETTLE_SECONDS, forward=True)

    def take_until(self, wanted: set[int], seconds: float, forward: bool) -> Iterator[pb.Event]:
        """Take events until every host in ``wanted`` has exited, or
        ``seconds``, or a cancel or timeout comes (kept as ``stopped``)."""
        deadline = time.monotonic() + seconds
        while not wanted <= self.exited:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                item = self.events.get(timeout=left)
            except queue.Empty:
                return
            if not isinstance(item, pb.Event):
                if self.stopped is None and (ending := self._ending_of(item)) is not None:
                    self.stopped = ending
                    return
                continue
            if forward:
                yield from forwarded(item)
            if item.HasField("done"):
                if self.reports[item.host].state in (pb.HOST_STATE_PENDING,
                                                      pb.HOST_STATE_RUNNING):
                    self.reports[item.host] = item.done
            elif item.HasField("exited"):
                self.record_exit(item)

    def raised(self) -> Iterator[pb.Event]:
        """A host raised: in a warm session, the session goes on if every
        other host comes back to rest within ``REST_SECONDS`` (its worker
        parked: it returned or raised too; after an interrupt, within
        ``INTERRUPT_SECONDS`` of it); otherwise, as ``fail``."""
        if self._session:
            window = REST_SECONDS
            if self.interrupted_at is not None:
                window = max(window, INTERRUPT_SECONDS
                             - (time.monotonic() - self.interrupted_at))
            yield from self.take_until(set(range(self.n)), window, forward=True)
            if self.stopped is not None:
                yield from self.fail(*self.stopped)
                return
            if self._all_parked():
                yield self._failed_at_rest()
                return
        if self.interrupted_at is not None:
            yield from self.fail(pb.JOB_STATE_CANCELLED, self.not_back())
            return
        yield from self.fail(pb.JOB_STATE_FAILED)

    def not_back(self) -> str:
        """Why an interrupted job was cancelled: the hosts not back to rest."""
        late = [i for i in range(self.n) if i not in self.exited]
        return (f"interrupted by its caller, and host{'s' if len(late) != 1 else ''} "
                f"{', '.join(map(str, late))} did not come back to rest within "
                f"{INTERRUPT_SECONDS:g} s: every host was stopped")

    def _all_parked(self) -> bool:
        return self._session and len(self.exited) == self.n and \
            all(r.warm for r in self.reports)

    def _failed_at_rest(self) -> pb.Event:
        """The end of a failed call whose every host is parked: the warm
        session goes on."""
        self.warm_kept = True
        if self.interrupted_at is not None:
            return pb.Event(host=0, end=pb.JobEnd(
                state=pb.JOB_STATE_CANCELLED, root_cause_host=-1, hosts=self.reports,
                detail=f"interrupted by its caller; {WARM_KEPT}", warm_kept=True))
        return pb.Event(host=0, end=pb.JobEnd(
            state=pb.JOB_STATE_FAILED, root_cause_host=root_cause(self.reports),
            hosts=self.reports, detail=WARM_KEPT, warm_kept=True))

    def stalled(self, stall: pb.StallReport, stacks: Sequence[pb.HostStacks]
                ) -> Iterator[pb.Event]:
        """on_stall="cancel": every host stopped, then the end
        ``gateway.stalls.stalled_end`` makes of their reports."""
        self.stop_all()
        yield from self.settle(forward=True)
        yield pb.Event(host=0, end=stalled_end(stall, stacks, self.reports,
                                               WARM_LOST if self._warm_call else ""))

    def fail(self, state: int, detail: str = "") -> Iterator[pb.Event]:
        self.stop_all()
        yield from self.settle(forward=True)
        if self._warm_call:
            detail = f"{detail}; {WARM_LOST}" if detail else WARM_LOST
        preempted = [r.host for r in self.reports if r.preempted]
        if preempted and state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED,
                                   pb.JOB_STATE_PREEMPTED):
            state = pb.JOB_STATE_PREEMPTED
            detail = (f"host {preempted[0]} was preempted (its metadata server says so); "
                      "the job can be submitted again once the slice is back"
                      + (f"; {WARM_LOST}" if self._warm_call else ""))
            yield pb.Event(host=0, end=pb.JobEnd(state=state, root_cause_host=preempted[0],
                                                 hosts=self.reports, detail=detail))
            return
        cause = root_cause(self.reports) if state == pb.JOB_STATE_FAILED else -1
        yield pb.Event(host=0, end=pb.JobEnd(state=state, root_cause_host=cause,
                                             hosts=self.reports, detail=detail))



def forwarded(item: object) -> Iterator[pb.Event]:
    """What of the hosts' events goes on to the caller as it comes."""
    if isinstance(item, pb.Event) and (item.HasField("output") or item.HasField("started")):
        yield item
