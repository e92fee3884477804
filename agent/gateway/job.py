"""The gateway: process 0 of a job. Fans the job out to the peers, merges every
host's events into one stream, and enforces fail-fast.

Preparing its own part (``host.preparing``) is the job's first step: a cancel and
the job's timeout end it there too.

The first host to fail is the root cause (``gateway.root_cause``): the gateway stops
every other host at once (SIGTERM, then SIGKILL to its process group) rather
than waiting for JAX's heartbeat timeout, then reports every host's final state.

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
from remote_tpu_agent.gateway.preflight import preflight
from remote_tpu_agent.gateway.peer_process import RemoteHost
from remote_tpu_agent.gateway.root_cause import root_cause
from remote_tpu_agent.worker.handle import ProcessHandle
from remote_tpu_agent.worker.run import WorkerRun
from remote_tpu_agent.worker.spares import Spares
from remote_tpu_agent.host.tpu import TpuGuard
from remote_tpu_agent.worker.environment import processes_per_host
from remote_tpu_agent.host.working_dirs import refs_of

log = logging.getLogger(__name__)

_SETTLE_SECONDS = 4.0        # wait this long for every host's final report
_TIMED_OUT = object()
WARM_LOST = ("the warm workers were stopped: remote_tpu.state and what was on the devices "
             "are gone, and the next call starts in fresh workers")


@dataclasses.dataclass
class _Cancel:
    reason: str
    state: int


class GatewayJob:
    """One job, seen from its gateway."""

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
        self.warm_kept = False           # every host parked: the session goes on
        self.coordinator = warm.coordinator if warm else \
            join_host_port(advertise, free_port(advertise))
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
        self.handles: list[ProcessHandle] = [*self.locals, *self.remotes]
        self.reports = [pb.HostReport(host=i, state=pb.HOST_STATE_PENDING)
                        for i in range(self.n)]
        self.done: set[int] = set()
        self.exited: set[int] = set()
        self.permanent = False            # a peer refused us for good (_preflight)
        self._emit_warm = ParkedWakes(self.events, self.n)    # a warm call's events

    def cancel(self, reason: str, state: int = pb.JOB_STATE_CANCELLED) -> None:
        """Stop the job on every host; it ends in ``state`` with ``reason``."""
        self.events.put(_Cancel(reason, state))

    def stacks(self) -> list[pb.HostStacks]:
        """Every host's Python stacks, collected in parallel."""
        if not self.locals:
            return [pb.HostStacks(host=0, text="(host 0 is preparing the job: no worker yet)")]
        with concurrent.futures.ThreadPoolExecutor(len(self.handles)) as pool:
            texts = list(pool.map(lambda h: h.stacks(), self.handles))
        return [pb.HostStacks(host=h.host, text=t) for h, t in zip(self.handles, texts)]

    # ------------------------------------------------------------------ run

    def run(self) -> Iterator[pb.Event]:
        """Every host's output (``started``, ``output``) as it comes, then ``end``."""
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
                    hosts=self.reports, detail="nothing was started on any host",
                    permanent=self.permanent))
                return
            yield from self._run()
        finally:
            if timer is not None:
                timer.cancel()
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
        """Process 0's pickled value when it came inline; else its file."""
        return self.local.result, self.local.result_file

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
        """(``_preflight``; in a warm session, the peers answered when it
        started: a peer gone since fails its call, and so the session.)"""
        if self.reuse is not None:
            return []
        refused, self.permanent = preflight(self.remotes, self.reports, self.tpu,
                                            self._silent, self._blob_problems)
        return refused

    def _ending(self, item: object) -> tuple[int, str] | None:
        """(state, why) a cancel or the timeout ends the job in; None for any other event."""
        if isinstance(item, _Cancel):
            return item.state, item.reason
        if item is _TIMED_OUT:
            return pb.JOB_STATE_TIMED_OUT, f"timed out after {self.spec.timeout_seconds:g} s"
        return None

    def _place_locals(self, prepared: Prepared) -> None:
        """This host's calls, and (cold) its workers, from what was prepared."""
        self._local_calls = local_calls(prepared, self.spec, self.job_dir, self.payload,
                                        self._blobs.results_dir if self._blobs else "")
        for k, call in enumerate([] if self.reuse else self._local_calls):
            self.locals.append(WorkerRun(host=k, call=call, emit=self.events.put,
                                         forward_output=True, warm=bool(self.session_id),
                                         spares=self._spares))
        self.local = self.locals[0]
        self.handles = [*self.locals, *self.remotes]

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
        while True:
            item = self.events.get()
            if isinstance(item, _Cancel):
                if item.state == pb.JOB_STATE_PREEMPTED:
                    self.reports[0].preempted = True
                yield from self._fail(item.state, item.reason)
                return
            if item is _TIMED_OUT:
                # The stacks say where each host was stuck: JAX cannot tell a live
                # but stuck rank from a slow one.
                for host_stacks in self.stacks():
                    self.reports[host_stacks.host].stacks = host_stacks.text
                yield from self._fail(pb.JOB_STATE_TIMED_OUT,
                                      f"timed out after {self.spec.timeout_seconds:g} s")
                return
            yield from self._forward(item)
            event: pb.Event = item
            if event.HasField("done"):
                self.reports[event.host] = event.done
                if event.done.state == pb.HOST_STATE_SUCCEEDED or self.spec.keep_going:
                    self.done.add(event.host)      # (a failure ends it in _succeed)
                    if len(self.done) == self.n:
                        yield from self._succeed()
                        return
                else:
                    yield from self._fail(pb.JOB_STATE_FAILED)
                    return
            elif event.HasField("exited"):
                self._record_exit(event)
                failed = event.exited.state != pb.HOST_STATE_SUCCEEDED
                if failed and not self.spec.keep_going:
                    yield from self._fail(pb.JOB_STATE_FAILED)
                    return
                if event.exited.warm or failed:   # parked (a peer sends no `done`), or died
                    self.done.add(event.host)
                    if len(self.done) == self.n:
                        yield from self._succeed()
                        return

    def _forward(self, item: object) -> Iterator[pb.Event]:
        if isinstance(item, pb.Event) and (item.HasField("output") or item.HasField("started")):
            yield item

    def _record_exit(self, event: pb.Event) -> None:
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

    def _settle(self, forward: bool, seconds: float = _SETTLE_SECONDS) -> Iterator[pb.Event]:
        """Take events until every host has exited or ``seconds`` have passed;
        a peer that has not confirmed by then is reported lost."""
        yield from self._await(set(range(self.n)), seconds, forward)
        for h in self.remotes:
            if h.host not in self.exited:
                detail = f"agent at {h.address} did not confirm the worker stopped"
                h.abandon(detail)
                self._record_exit(pb.Event(host=h.host, exited=pb.HostReport(
                    host=h.host, state=pb.HOST_STATE_LOST, detail=detail,
                    finished_at=time.time())))

    def _stop_all(self) -> None:
        for h in self.handles:
            if h.host not in self.exited:
                threading.Thread(target=h.cancel, daemon=True).start()

    def _succeed(self) -> Iterator[pb.Event]:
        # Peers go first; process 0 keeps JAX's coordination service up until last.
        others = [*self.remotes, *self.locals[1:]]
        for handle in others:
            handle.release()
        yield from self._settle_hosts(others)
        self.local.release()
        yield from self._settle_hosts([self.local])
        lost = [r for r in self.reports if r.state != pb.HOST_STATE_SUCCEEDED]
        if lost:
            yield from self._fail(pb.JOB_STATE_FAILED)
            return
        self.warm_kept = bool(self.session_id) and all(r.warm for r in self.reports)
        yield pb.Event(host=0, end=pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED, root_cause_host=-1,
                                             hosts=self.reports,
                                             result_digest=self.local.result_digest))

    def _settle_hosts(self, handles: Sequence[ProcessHandle]) -> Iterator[pb.Event]:
        """Wait for these released hosts to exit; stop those that do not."""
        wanted = {h.host for h in handles}
        yield from self._await(wanted, _SETTLE_SECONDS, forward=True)
        for h in handles:
            if h.host not in self.exited:
                if isinstance(h, RemoteHost):
                    h.abandon(f"agent at {h.address} did not confirm the worker exited")
                else:
                    h.cancel()
        yield from self._await(wanted, _SETTLE_SECONDS, forward=True)

    def _await(self, wanted: set[int], seconds: float, forward: bool) -> Iterator[pb.Event]:
        """Take events until every host in ``wanted`` has exited, or ``seconds``."""
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
                continue
            if forward:
                yield from self._forward(item)
            if item.HasField("done"):
                if self.reports[item.host].state in (pb.HOST_STATE_PENDING,
                                                      pb.HOST_STATE_RUNNING):
                    self.reports[item.host] = item.done
            elif item.HasField("exited"):
                self._record_exit(item)

    def _fail(self, state: int, detail: str = "") -> Iterator[pb.Event]:
        self._stop_all()
        yield from self._settle(forward=True)
        if self.reuse is not None:
            detail = f"{detail}; {WARM_LOST}" if detail else WARM_LOST
        preempted = [r.host for r in self.reports if r.preempted]
        if preempted and state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED,
                                   pb.JOB_STATE_PREEMPTED):
            state = pb.JOB_STATE_PREEMPTED
            detail = (f"host {preempted[0]} was preempted (its metadata server says so); "
                      "the job can be submitted again once the slice is back"
                      + (f"; {WARM_LOST}" if self.reuse is not None else ""))
            yield pb.Event(host=0, end=pb.JobEnd(state=state, root_cause_host=preempted[0],
                                                 hosts=self.reports, detail=detail))
            return
        cause = root_cause(self.reports) if state == pb.JOB_STATE_FAILED else -1
        yield pb.Event(host=0, end=pb.JobEnd(state=state, root_cause_host=cause,
                                             hosts=self.reports, detail=detail))

