"""The peer role: this host's part of a job some gateway runs.

A gateway sends each of its peers one ``Run`` call per JAX process that host
runs (``role = PEER``). The peer receives the payload, starts the worker, and
streams its output and exit back; it obeys the gateway's controls on the same
call (release: the worker may exit; cancel: stop it). A host runs one job's
workers at a time; when the gateway's call ends, the worker is stopped.

In a warm session (``keep_warm``) that call stays open between calls: once the
function has returned the worker parks (its ``exited`` event says ``warm``),
and the session's next call comes on the same call (``next_call``, then its
payload) and runs in the same worker. The gateway ends the session by ending
the call; a gateway that dies or drops off the network ends it too, since gRPC's
keepalive then ends the call.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import phase_of_host

from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.jobs.attempts import run_key
from remote_tpu_agent.worker.call import Call
from remote_tpu_agent.jobs.events import EventQueue
from remote_tpu_agent.host.shared import Host
from remote_tpu_agent.jobs.host_log import StoreFull
from remote_tpu_agent.wire.peer_lane import PeerLane
from remote_tpu_agent.jobs.requests import Refused, abort
from remote_tpu_agent.worker.run import WorkerRun
from remote_tpu_agent.host.envs import EnvError
from remote_tpu_agent.host.preparing import NotPrepared, prepare_saying
from remote_tpu_agent.worker.processes import Children, Stopped
from remote_tpu_agent.host.output_dir import OutputSync
from remote_tpu_agent.jobs.store import JobRecord
from remote_tpu_agent.host.working_dirs import place_job, refs_of
from remote_tpu_agent.host.tpu import TpuBusy

log = logging.getLogger(__name__)

STREAMS = 64          # calls from gateways at once: one per process of this host's job


class PeerRole:
    def __init__(self, host: Host) -> None:
        self._host = host
        # A host runs one job's workers at a time (several when processes_per_host > 1).
        self._slot = threading.Condition()
        self._job = ""
        self._count = 0
        self._runs: dict[tuple[str, int], WorkerRun] = {}

    def stacks(self, job_id: str) -> list[pb.HostStacks] | None:
        """This host's workers' stacks in ``job_id``, or None when it runs none."""
        runs = [run for (job, _), run in list(self._runs.items()) if job == job_id]
        return [pb.HostStacks(host=run.host, text=run.stacks()) for run in runs] or None

    def stop_all(self) -> None:
        for run in list(self._runs.values()):
            run.stop()

    def run(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
            context: grpc.ServicerContext) -> Iterator[pb.Event]:
        """This host's part of a gateway's job: one worker, obeying the gateway."""
        with self._slot:
            free = self._slot.wait_for(
                lambda: self._count == 0 or self._job == spec.job_id, timeout=5)
            if not free:
                abort(context, Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                    f"host {self._host.endpoint()} is still running job {self._job}'s worker"))
            self._job = spec.job_id
            self._count += 1
        mine = pb.JobSpec()
        mine.CopyFrom(spec)
        mine.job_id = f"{run_key(spec)}.p{spec.process_id}"   # this process's own record
        mine.ClearField("payload")
        payload_file = ""
        pinned: list[pb.BlobRef] = []      # the current call's large buffers, pinned here
        try:
            record, created = self._host.store.create(mine, pb.ROLE_PEER)
            if not created:
                abort(context, Refused(grpc.StatusCode.ALREADY_EXISTS, "protocol",
                                       f"job {spec.job_id} already ran on this host"))
            payload_file = os.path.join(record.dir, _worker.PAYLOAD_FILE)
            payload = self._host.uploads.receive(spec, requests, payload_file, context)
            try:
                self._host.tpu.prepare()
            except TpuBusy as exc:
                record.set_phase(pb.JOB_PHASE_FAILED, str(exc))
                abort(context, Refused(grpc.StatusCode.FAILED_PRECONDITION, "busy",
                                       f"host {self._host.endpoint()}: {exc}"))
            paths, why = self._pin(spec)
            if paths is None:
                record.set_phase(pb.JOB_PHASE_FAILED, why)
                abort(context, Refused(grpc.StatusCode.FAILED_PRECONDITION, "blobs-missing",
                                       why))
            pinned[:] = refs_of(spec)
            record.set_phase(pb.JOB_PHASE_RUNNING)
            yield from self._events(spec, payload, requests, record, context, paths, pinned)
        finally:
            self._host.blobs.unpin(pinned)
            if payload_file and os.path.exists(payload_file):
                os.unlink(payload_file)
            with self._slot:
                self._count -= 1
                if not self._count:
                    self._job = ""
                self._slot.notify_all()

    def _call(self, spec: pb.JobSpec, payload: bytes | str, record: JobRecord,
              blob_paths: list[str], say: Callable[[str], None],
              children: Children) -> Call:
        """The worker's call: its trees placed here first, its environment made
        (its installer's lines to ``say``, its processes as ``children``).
        NotPrepared, Stopped."""
        try:
            call_paths, working_dir, data = place_job(self._host.workdirs, spec, blob_paths)
            env = {**self._host.env_for(spec, spec.process_id, spec.coordinator_address),
                   **self._host.envs.for_job(spec, self._host.simulated, say, children)}
        except (OSError, ValueError, EnvError) as exc:
            raise NotPrepared(f"host {self._host.endpoint()} could not prepare the call: "
                              f"{exc}") from exc
        return Call(job_dir=record.dir, payload=payload, digest=spec.payload_digest.hex(),
                    env=env,
                    blobs=call_paths, working_dir=working_dir, data=data,
                    gcs_data=list(spec.gcs_data))

    def _unplaced(self, host: int, exc: BaseException) -> pb.Event:
        """The host's end when its call could not be prepared, or was stopped."""
        stopped = isinstance(exc, Stopped)
        return pb.Event(host=host, exited=pb.HostReport(
            host=host, state=pb.HOST_STATE_CANCELLED if stopped else pb.HOST_STATE_FAILED,
            exited=True, finished_at=time.time(), detail=(
                f"host {self._host.endpoint()} stopped preparing the call: {exc}"
                if stopped else str(exc))))

    def _pin(self, spec: pb.JobSpec) -> tuple[list[str] | None, str]:
        """Pin the call's large buffers here (the gateway made sure this host
        had them just before): their paths, or None and why not."""
        paths = self._host.blobs.pin(refs_of(spec))
        if paths is not None:
            return paths, ""
        too_small = self._host.blobs.too_small(refs_of(spec))
        if too_small:
            return None, f"host {self._host.endpoint()}: {too_small}"
        missing = len(self._host.blobs.missing(refs_of(spec)))
        return None, (f"host {self._host.endpoint()} lacks {missing} of the call's large "
                      "argument buffers (its argument cache evicted them): call again")

    def _events(self, spec: pb.JobSpec, payload: bytes | str,
                requests: Iterator[pb.RunRequest], record: JobRecord,
                context: grpc.ServicerContext, blob_paths: list[str],
                pinned: list[pb.BlobRef]) -> Iterator[pb.Event]:
        events = EventQueue()
        # Until its worker starts, the call is its preparation (``children``),
        # which a cancel or the gateway going away stops; then, its worker.
        children = Children()
        gate = threading.Lock()                 # a cancel, and the worker's start
        run: WorkerRun | None = None
        outputs = [self._outputs(spec, record)]       # the current call's
        on_lane = [False]                       # the current call came on the lane

        def keep(event: pb.Event) -> None:      # this host's own copy
            try:
                record.append_output(event.host, event.output.stream, event.output.data)
            except StoreFull as exc:
                log.error("job %s: %s", spec.job_id, exc.strerror)

        def direct(event: pb.Event) -> None:
            """A lane call's events, sent on the lane by the thread that made
            them (the worker's output and status readers; each waits for the
            ones before it: ``WorkerRun``), so a warm call wakes no other thread
            here. What ends the session goes to this call's own thread."""
            if event.HasField("output"):
                keep(event)
            elif event.HasField("done") and event.done.warm:
                return              # the worker parked: its `exited` (warm) says it all
            elif event.HasField("exited") and event.exited.warm:
                event.exited.notices.extend(outputs[0].finish())   # saved before it reports
                self._host.blobs.unpin(pinned)      # before the gateway can send the next
                pinned.clear()
            else:
                events.put(event)
                return
            if not lane.send(event):
                events.put(_Kept(event))            # the lane is gone: on gRPC

        def begin(next_spec: pb.JobSpec, data: bytes | str, came_on_lane: bool) -> None:
            """Hand the session's next call to the parked worker, in the thread
            that received it (no hand-off on the way)."""
            on_lane[0] = came_on_lane
            say = (lambda e: None if lane.send(e) else events.put(_Kept(e))) \
                if came_on_lane else (lambda e: events.put(_Kept(e)))
            self._begin(run, next_spec, data, record, pinned, outputs, events,
                        say, direct if came_on_lane else events.put)

        def lane_call(next_spec: pb.JobSpec) -> None:
            data = next_spec.payload
            next_spec.ClearField("payload")       # (the worker checks its digest)
            begin(next_spec, data, True)
        def new_lane() -> PeerLane:
            return PeerLane(lane_call, lambda: threading.Thread(target=cancel,
                                                                daemon=True).start())
        lane = new_lane()

        def cancel(why: str = "cancelled by its gateway", end: bool = False) -> None:
            with gate:
                children.stop(why)
                started = run
            if started is not None and end:
                started.stop()
            elif started is not None:
                started.cancel()

        def obey() -> None:
            try:
                for req in requests:
                    kind = req.WhichOneof("kind")
                    if kind == "next_call" and run is not None and run.warm:
                        data = self._host.uploads.receive(
                            req.next_call, requests,
                            os.path.join(record.dir, _worker.PAYLOAD_FILE), context)
                        begin(req.next_call, data, False)
                    elif req.control == pb.CONTROL_RELEASE and run is not None:
                        run.release()
                    elif req.control == pb.CONTROL_CANCEL:
                        threading.Thread(target=cancel, daemon=True).start()
                    else:
                        log.warning("job %s: ignoring unexpected request %s", spec.job_id,
                                    kind or f"control {req.control}")
            except grpc.RpcError:
                pass
            except Exception:  # noqa: BLE001 - the stream ended under us
                log.debug("control stream ended", exc_info=True)
            finally:
                events.put(None)

        def on_done() -> None:         # the gateway's call is over: so is the worker
            lane.close()
            threading.Thread(target=cancel, args=("the gateway's call ended", True),
                             daemon=True).start()
            events.put(None)
        context.add_callback(on_done)
        threading.Thread(target=obey, daemon=True, name="peer-control").start()
        log.info("job %s: host %d, coordinator %s", spec.job_id, spec.process_id,
                 spec.coordinator_address)
        final = pb.JOB_PHASE_LOST
        try:
            made = yield from prepare_saying(
                lambda say: self._call(spec, payload, record, blob_paths, say, children),
                children, events, lambda line: _said(spec.process_id, record, line))
            with gate:
                if isinstance(made, Call) and not children.stopped:
                    run = self._start(spec, call=made, events=events)
            if isinstance(made, Call) and run is None:        # cancelled as it was made
                made = Stopped(children.stopped)
            if isinstance(made, BaseException):
                end = self._unplaced(spec.process_id, made)
                yield end
                final = phase_of_host(end.exited.state)
            if run is None:
                return
            while True:
                event = events.get()
                if event is None:
                    return
                if isinstance(event, _Kept):      # dealt with: only to send
                    yield from _deliver(event.event, lane, on_lane[0])
                    continue
                if event.HasField("output"):
                    keep(event)
                if event.HasField("exited") and event.exited.state != pb.HOST_STATE_SUCCEEDED:
                    event.exited.preempted = self._host.preempted()
                if event.HasField("done") and event.done.warm:
                    continue        # the worker parked: its `exited` (warm) says it all
                if event.HasField("done") or event.HasField("exited"):
                    report = event.done if event.HasField("done") else event.exited
                    report.notices.extend(outputs[0].finish())   # saved before it reports
                if event.HasField("exited") and event.exited.warm and not on_lane[0]:
                    if lane.ended:          # broke between calls (this one came on gRPC)
                        lane = new_lane()
                    if not lane.offered and (offer := lane.offer(self._host.data_port())):
                        yield pb.Event(host=event.host, lane=offer)
                if event.HasField("exited") and event.exited.warm:
                    # Before the gateway hears of it (and may send the next call):
                    self._host.blobs.unpin(pinned)      # its worker has them mapped
                    pinned.clear()
                yield from _deliver(event, lane, on_lane[0])
                if not event.HasField("exited"):
                    continue
                final = phase_of_host(event.exited.state)
                if event.exited.preempted:
                    final = pb.JOB_PHASE_PREEMPTED
                if not event.exited.warm:
                    return
                # Warm: the session's next call comes on gRPC (``obey``: its
                # events then come here) or on the lane (``direct``).
        finally:
            lane.close()
            outputs[0].finish()
            events.close()
            children.stop("the call is over")
            if run is not None:
                self._end_run(run, record, spec)
            self._host.tpu.release()
            record.set_phase(final, "" if final != pb.JOB_PHASE_LOST else
                             "the gateway went away before this host finished")

    def _start(self, spec: pb.JobSpec, call: Call, events: EventQueue) -> WorkerRun:
        """Start the call's worker, its events to ``events``."""
        run = WorkerRun(host=spec.process_id, call=call, emit=events.put, forward_output=True,
                        warm=spec.keep_warm_seconds > 0, spares=self._host.spares)
        # A parked worker that dies ends the call, so its gateway knows the
        # session is over (its last `exited` event was the warm one).
        run.on_parked_exit = lambda: events.put(None)
        self._runs[(spec.job_id, spec.process_id)] = run
        run.start()
        return run

    def _end_run(self, run: WorkerRun, record: JobRecord, spec: pb.JobSpec) -> None:
        """The call is over: its worker too (what it printed while parked kept)."""
        if run.parked:              # printed since the session's last call: kept here
            for stream, data in run.parked_output():
                try:
                    record.append_output(run.host, stream, data)
                except StoreFull:
                    break
        run.stop()
        run.finished.wait(5)
        self._runs.pop((spec.job_id, spec.process_id), None)

    def _outputs(self, spec: pb.JobSpec, record: JobRecord) -> OutputSync:
        return OutputSync(spec, self._host.store.state_dir, [spec.process_id], record.say,
                          self._host.output_interval).start()

    def _begin(self, run: WorkerRun, spec: pb.JobSpec, payload: bytes | str,
               record: JobRecord, pinned: list[pb.BlobRef], outputs: list[OutputSync],
               events: EventQueue, say: Callable[[pb.Event], None],
               emit: Callable[[pb.Event], None]) -> None:
        """Hand a warm session's next call to the parked worker, its events to
        ``emit``. What preparing it said goes to ``say`` first; so does why it
        could not start, and the session then ends (its events end too)."""
        paths, why = self._pin(spec)
        if paths is None:
            say(pb.Event(host=run.host, exited=pb.HostReport(
                host=run.host, state=pb.HOST_STATE_LOST, finished_at=time.time(),
                detail=why)))
            events.put(None)
            return
        self._host.blobs.unpin(pinned)          # the last call's: its worker mapped them
        pinned[:] = refs_of(spec)
        try:                                    # (the session's own environment: made)
            call = self._call(spec, payload, record, paths,
                              lambda line: say(_said(run.host, record, line)), Children())
        except (NotPrepared, Stopped) as exc:
            say(self._unplaced(run.host, exc))
            events.put(None)
            return
        outputs[0] = self._outputs(spec, record)
        if not run.next_call(call, emit):
            say(pb.Event(host=run.host, exited=pb.HostReport(
                host=run.host, state=pb.HOST_STATE_DIED, exited=True,
                detail="its warm worker had exited since the last call")))
            events.put(None)


class _Kept:
    """An event already dealt with here, for the call's thread only to send."""

    __slots__ = ("event",)

    def __init__(self, event: pb.Event) -> None:
        self.event = event


def _deliver(event: pb.Event, lane: PeerLane, on_lane: bool) -> Iterator[pb.Event]:
    """Send an event back the way its call came (yielded: on the gRPC call,
    also where the lane is gone)."""
    if not (on_lane and lane.send(event)):
        yield event


def _said(host: int, record: JobRecord, line: str) -> pb.Event:
    """What the agent itself said for this host (an installer's output), as
    the host's stderr: kept here, and sent to the gateway."""
    return pb.Event(host=host, output=pb.Output(stream=pb.OUTPUT_STREAM_STDERR,
                                                data=record.say(host, line)))
