"""The gateway: process 0 of a job. Fans the job out to the peers, merges every
host's events into one stream, and enforces fail-fast.

Preparing its own part (``host.preparing``) is the job's first step: a cancel and
the job's timeout end it there too.

The first host to fail is the root cause (``gateway.root_cause``): the gateway stops
every other host at once (SIGTERM, then SIGKILL to its process group) rather
than waiting for JAX's heartbeat timeout, then reports every host's final state
(``gateway.ending``: how the job ends from its hosts' reports).

With ``keep_warm`` (or in a warm session, ``gateway.warm``) the workers outlive the
call: once their function returns they park, and the job is over once every
host has parked. A call that does not end so ends the session: every worker of
it is stopped, here and on the peers, and the caller is told the warm state is gone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from remote_tpu._core.addresses import free_port, join_host_port
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.channels import Credentials

from remote_tpu_agent.host.blob_sends import ensure_on
from remote_tpu_agent.host.blobs import BlobCache
from remote_tpu_agent.worker.call import Call
from remote_tpu_agent.jobs.events import EventQueue
from remote_tpu_agent.host.preparing import Prepared, local_calls, prepare_or_end
from remote_tpu_agent.worker.processes import Children
from remote_tpu_agent.gateway.warm import ParkedWakes, WarmSession, new_session_id, session_record
from remote_tpu._core.limits import INTERRUPT_SECONDS
from remote_tpu_agent.gateway.ending import WARM_LOST, JobEnding, forwarded
from remote_tpu_agent.gateway.preflight import preflight
from remote_tpu_agent.gateway.stalls import StallWatch, report as stall_report
from remote_tpu_agent.gateway.timeline import Timeline
from remote_tpu_agent.gateway.metrics import JobMetrics
from remote_tpu_agent.gateway.peer_process import RemoteHost
from remote_tpu_agent.worker.handle import ProcessHandle
from remote_tpu_agent.worker.run import WorkerRun
from remote_tpu_agent.worker.spares import Spares
from remote_tpu_agent.host.tpu import TpuGuard
from remote_tpu_agent.worker.environment import processes_per_host
from remote_tpu_agent.host.working_dirs import refs_of

log = logging.getLogger(__name__)

_TIMED_OUT = object()
_INTERRUPTED = object()         # the caller's first Ctrl-C (``GatewayJob.interrupt``)
_INTERRUPT_OVER = object()      # ... INTERRUPT_SECONDS ago, and the job still runs
_STALL_CHECK = object()         # stall_after=: no event came for a while; look


@dataclasses.dataclass
class _Stalled:
    report: pb.StallReport
    stacks: list[pb.HostStacks]
    since: float               # the quiet spell's start (``StallWatch.quiet_since``)


@dataclasses.dataclass
class _Cancel:
    reason: str
    state: int


class GatewayJob:
    """One job, seen from its gateway: set up across hosts, started, and its
    events fed to its ``JobEnding``.

    Why over 200 lines: a cold job and a warm session's call share the set-up
    and the loop, and differ in a few lines of each step; split by the two,
    every step would be written twice."""

    def __init__(self, *, spec: pb.JobSpec, hosts: Sequence[str], job_dir: str,
                 payload: bytes | str, advertise: str,
                 prepare: Callable[[Children, str], Prepared],
                 peer_credentials: Credentials, tpu: TpuGuard | None = None,
                 preempted=lambda: False, warm: WarmSession | None = None,
                 spares: Spares | None = None, blobs: BlobCache | None = None) -> None:
        self.tpu = tpu
        self._preempted = preempted
        self.spec = spec
        per_host = processes_per_host(spec)
        self.n = len(hosts) * per_host        # JAX processes; "host" below means one of them
        self.events = EventQueue()
        # A warm session's workers run this call (reuse), or this call starts one.
        self.reuse = warm
        self.session_id = warm.id if warm else (
            new_session_id() if spec.keep_warm_seconds > 0 else "")
        self.coordinator = warm.coordinator if warm else \
            join_host_port(advertise, free_port())
        self._peer_credentials = peer_credentials
        self._blobs = blobs
        self._blob_problems: dict[str, str] = {}     # peer agent: why it lacks the buffers
        self._silent: set[str] = set()               # peer agents that did not even answer
        self.job_dir = job_dir
        self._prepare = prepare
        self.children = Children()       # what preparing runs (installers, probes)
        self._spares = spares
        # This host's processes, once prepared (warm: the session's, given the new calls).
        self.locals = list(warm.locals) if warm else []
        self._local_calls: list[Call] = []
        self.payload = payload
        self._peer_specs = []
        for i in range(1, len(hosts)):
            for k in range(per_host):
                peer_spec = pb.JobSpec()
                peer_spec.CopyFrom(spec)
                peer_spec.role = pb.ROLE_PEER
                peer_spec.process_id = i * per_host + k
                peer_spec.coordinator_address = self.coordinator
                peer_spec.keep_warm_seconds = 1 if self.session_id else 0     # open: warm
                self._peer_specs.append((hosts[i], peer_spec))
        self.remotes = list(warm.remotes) if warm else [
            RemoteHost(host=s.process_id, address=address, spec=s, payload=payload,
                       emit=self.events.put, credentials=peer_credentials)
            for address, s in self._peer_specs]
        self.end = JobEnding(spec=spec, n=self.n, events=self.events, locals_=self.locals,
                             remotes=self.remotes, warm_call=warm is not None,
                             session=bool(self.session_id), preempted=preempted,
                             ending_of=self._ending, job_dir=job_dir)
        self._interrupt_timer: threading.Timer | None = None
        self.permanent = False            # a peer refused us for good (gateway.preflight)
        self._skew = ""                   # the hosts' versions, where they differ
        self._emit_warm = ParkedWakes(self.events, self.n)    # a warm call's events
        self.timeline = Timeline(self.n)
        self.metrics = JobMetrics(self.n)      # remote-tpu top (``gateway.metrics``)

    @property
    def handles(self) -> list[ProcessHandle]:
        return self.end.handles

    @property
    def warm_kept(self) -> bool:
        """Every host parked: the warm session goes on."""
        return self.end.warm_kept

    def cancel(self, reason: str, state: int = pb.JOB_STATE_CANCELLED) -> None:
        """Stop the job on every host; it ends in ``state`` with ``reason``."""
        self.events.put(_Cancel(reason, state))

    def interrupt(self) -> None:
        """The caller's first Ctrl-C: KeyboardInterrupt in the function on
        every host. In a warm session its workers stay if every host comes
        back to rest within ``INTERRUPT_SECONDS`` (``JobEnding.raised``); else
        it is cancelled. A cold job's workers end anyway: it is a cancel."""
        if not self.session_id:
            self.cancel("interrupted by its caller")
            return
        self.events.put(_INTERRUPTED)

    def _interrupt_hosts(self) -> None:
        if self.end.interrupted_at is not None:
            return
        self.end.interrupted_at = time.monotonic()
        for h in self.handles:          # (a send to a peer may block: not this thread)
            if h.host not in self.end.exited:
                threading.Thread(target=h.interrupt, daemon=True, name="interrupt").start()
        self._interrupt_timer = threading.Timer(INTERRUPT_SECONDS, self.events.put,
                                                (_INTERRUPT_OVER,))
        self._interrupt_timer.daemon = True
        self._interrupt_timer.start()

    def stacks(self) -> list[pb.HostStacks]:
        """Every host's Python stacks, collected in parallel."""
        if not self.locals:
            return [pb.HostStacks(host=0, text="(host 0 is preparing the job: no worker yet)")]
        with concurrent.futures.ThreadPoolExecutor(len(self.handles)) as pool:
            texts = list(pool.map(lambda h: h.stacks(), self.handles))
        return [pb.HostStacks(host=h.host, text=t) for h, t in zip(self.handles, texts)]

    # ------------------------------------------------------------------ run

    def run(self) -> Iterator[pb.Event]:
        """Every host's output (``started``, ``output``) as it comes, then
        ``end``, with the job's timeline (``gateway.timeline``)."""
        for event in self._run_all():
            if event.HasField("end"):
                self.timeline.fill(event.end)
            yield event

    def _run_all(self) -> Iterator[pb.Event]:
        timer = None
        if self.spec.timeout_seconds > 0:      # from the start: preparing counts
            timer = threading.Timer(self.spec.timeout_seconds, self.events.put, (_TIMED_OUT,))
            timer.daemon = True
            timer.start()
        try:
            made = prepare_or_end(lambda children: self._prepare(children, self.coordinator),
                                  self.children, self.events, self._ending)
            if isinstance(made, pb.JobEnd):
                if self.reuse is not None and made.state != pb.JOB_STATE_FAILED:
                    made.detail = f"{made.detail}; {WARM_LOST}"
                yield pb.Event(host=0, end=made)
                return
            self._place_locals(made)
            if self._blobs is not None:
                self._blob_problems, self._silent = ensure_on(
                    [r.address for r in self.remotes], refs_of(self.spec),
                    self._blobs.path, self._peer_credentials)
            refused = self._preflight()
            if refused:
                yield pb.Event(host=0, end=pb.JobEnd(
                    state=pb.JOB_STATE_FAILED, root_cause_host=refused[0].host,
                    hosts=self.end.reports, permanent=self.permanent,
                    detail="nothing was started on any host"
                           + (f"; {self._skew}" if self._skew else "")))
                return
            yield from self._run()
        finally:
            for pending in (timer, self._interrupt_timer):
                if pending is not None:
                    pending.cancel()
            self.children.stop("the job is over")
            self.events.close()
            for h in [] if self.warm_kept else self.handles:   # (kept: the session's next
                h.close()                              # call may be using them)
            if self.session_id and not self.warm_kept:   # ends its warm session:
                for h in self.handles:                   # (a peer's worker ends with its call)
                    h.stop()
            if self.tpu is not None:
                self.tpu.release()

    def result_data(self) -> tuple[bytes | None, str]:
        """Process 0's pickled value when it came inline; else its file
        (all_results=: every process's, joined)."""
        if self.end.joined is not None:
            return self.end.joined.data, self.end.joined.path
        return self.end.local.result, self.end.local.result_file

    def kept_session(self, store) -> WarmSession | None:
        """The warm session this job's parked workers make (or go on), once it
        ended with every host parked; None otherwise."""
        if not self.warm_kept:
            return None
        return self.reuse or WarmSession(
            session_id=self.session_id, spec=self.spec, coordinator=self.coordinator,
            locals_=self.locals, remotes=self.remotes,
            record=session_record(store, self.spec, self.session_id))

    def _preflight(self) -> list[pb.HostReport]:
        """(``gateway.preflight``; in a warm session, the peers answered when it
        started: a peer gone since fails its call, and so the session.)"""
        if self.reuse is not None:
            return []
        refused, self.permanent, self._skew = preflight(
            self.remotes, self.end.reports, self.tpu, self._silent, self._blob_problems)
        return refused

    def _ending(self, item: object) -> tuple[int, str] | None:
        """(state, why) a cancel or the timeout ends the job in; None for any other event."""
        if isinstance(item, _Cancel):
            return item.state, item.reason
        if item is _TIMED_OUT:
            return pb.JOB_STATE_TIMED_OUT, f"timed out after {self.spec.timeout_seconds:g} s"
        if item is _INTERRUPT_OVER:
            return pb.JOB_STATE_CANCELLED, self.end.not_back()
        return None

    def _place_locals(self, prepared: Prepared) -> None:
        """This host's calls, and (cold) its workers, from what was prepared."""
        self._local_calls = local_calls(prepared, self.spec, self.job_dir, self.payload,
                                        self._blobs.results_dir if self._blobs else "")
        for k, call in enumerate([] if self.reuse else self._local_calls):
            self.locals.append(WorkerRun(host=k, call=call, emit=self.events.put,
                                         forward_output=True, warm=bool(self.session_id),
                                         spares=self._spares))

    def _run(self) -> Iterator[pb.Event]:
        # Process 0 hosts the JAX coordinator: start it first. (Warm, it is up:
        # the peers' calls go first, each on its way while the next is sent.)
        if not self.reuse:
            self._start_locals()
        self._start_remotes()
        if self.reuse:
            self._start_locals()
        yield from self._main_loop()

    def _start_locals(self) -> None:
        for local, call in zip(self.locals, self._local_calls):
            if not self.reuse:
                local.start()
            elif not local.next_call(call, self._emit_warm):
                self.events.put(pb.Event(host=local.host, exited=pb.HostReport(
                    host=local.host, state=pb.HOST_STATE_DIED, exited=True, finished_at=time.time(),
                    detail="its warm worker had exited since the last call")))

    def _start_remotes(self) -> None:
        for remote, (_, spec) in zip(self.remotes, self._peer_specs):
            if not self.reuse:
                remote.start()
            elif remote.address in self._blob_problems:
                remote.stop()
                self.events.put(pb.Event(host=remote.host, exited=pb.HostReport(
                    host=remote.host, state=pb.HOST_STATE_LOST, finished_at=time.time(),
                    detail=self._blob_problems[remote.address])))
            elif not remote.next_call(spec, self.payload, self._emit_warm):
                self.events.put(pb.Event(host=remote.host, exited=pb.HostReport(
                    host=remote.host, state=pb.HOST_STATE_LOST, finished_at=time.time(),
                    detail=f"agent at {remote.address} dropped the warm session's call")))

    def _main_loop(self) -> Iterator[pb.Event]:
        after = self.spec.stall_after_seconds
        starting = 0 if self.reuse else self.n        # (a warm call's workers are up)
        yield from self._events(StallWatch(after, starting) if after > 0 else None)

    def _stall_report(self, quiet: float, since: float) -> None:
        """(A thread of its own: the stacks take up to a second.)"""
        stacks = self.stacks()
        self.events.put(_Stalled(stall_report(self.spec.job_id, quiet, stacks,
                                              self.spec.cancel_on_stall), stacks, since))

    def _events(self, watch: StallWatch | None) -> Iterator[pb.Event]:
        end = self.end
        while True:
            try:
                item = self.events.get(None if watch is None else watch.every)
            except queue.Empty:
                item = _STALL_CHECK
            self.timeline.saw(item)
            self.metrics.saw(item)
            if watch is not None:
                watch.saw(item)
                if (quiet := watch.due()) is not None:
                    threading.Thread(target=self._stall_report, daemon=True,
                                     args=(quiet, watch.quiet_since), name="stall-report").start()
            if item is _STALL_CHECK:
                continue
            if isinstance(item, _Stalled):
                if watch is not None and watch.moved_since(item.since):
                    continue           # it moved while the stacks were taken: no stall
                yield pb.Event(host=0, stall=item.report)
                if item.report.cancelled:
                    yield from end.stalled(item.report, item.stacks)
                    return
                continue
            if item is _INTERRUPTED:
                self._interrupt_hosts()
                continue
            if item is _INTERRUPT_OVER:
                yield from end.fail(*self._ending(item))
                return
            if isinstance(item, _Cancel):
                if item.state == pb.JOB_STATE_PREEMPTED:
                    end.reports[0].preempted = True
                yield from end.fail(item.state, item.reason)
                return
            if item is _TIMED_OUT:
                # The stacks say where each host was stuck: JAX cannot tell a live
                # but stuck rank from a slow one.
                for host_stacks in self.stacks():
                    end.reports[host_stacks.host].stacks = host_stacks.text
                yield from end.fail(pb.JOB_STATE_TIMED_OUT,
                                      f"timed out after {self.spec.timeout_seconds:g} s")
                return
            yield from forwarded(item)
            event: pb.Event = item
            if event.HasField("done"):
                end.reports[event.host] = event.done
                if event.done.state == pb.HOST_STATE_SUCCEEDED or self.spec.keep_going:
                    end.done.add(event.host)      # (a failure ends it in succeed)
                    if len(end.done) == self.n:
                        yield from end.succeed()
                        return
                elif event.done.warm:         # raised, and parked: see JobEnding.raised
                    end.record_exit(pb.Event(host=event.host, exited=event.done))
                    yield from end.raised()
                    return
                else:
                    yield from end.fail(pb.JOB_STATE_FAILED)
                    return
            elif event.HasField("exited"):
                end.record_exit(event)
                failed = event.exited.state != pb.HOST_STATE_SUCCEEDED
                if failed and not self.spec.keep_going:
                    yield from (end.raised() if event.exited.warm
                                else end.fail(pb.JOB_STATE_FAILED))
                    return
                if event.exited.warm or failed:   # parked (a peer sends no `done`), or died
                    end.done.add(event.host)
                    if len(end.done) == self.n:
                        yield from end.succeed()
                        return
