"""One gateway call on this host (``PeerCall``): its call prepared and its
worker started, the gateway's controls obeyed, its events sent back the way
they came.

Until its worker starts, the call is its preparation (``children``), which a
cancel or the gateway going away stops; then, its worker. In a warm session the
worker parks after each call, and the session's next call comes either on the
gRPC call (``next_call``: its events then pass through ``events()``) or on the
lane (``PeerLane``: its events are sent there by the threads that make them,
``_direct``), so a warm call wakes no other thread here.
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

from remote_tpu_agent.host.envs import EnvError
from remote_tpu_agent.host.output_dir import OutputSync
from remote_tpu_agent.host.preparing import NotPrepared, prepare_saying
from remote_tpu_agent.host.shared import Host
from remote_tpu_agent.host.working_dirs import place_job, refs_of
from remote_tpu_agent.jobs.events import EventQueue
from remote_tpu_agent.jobs.host_log import StoreFull
from remote_tpu_agent.jobs.store import JobRecord
from remote_tpu_agent.wire.peer_lane import PeerLane
from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.worker.call import Call
from remote_tpu_agent.worker.processes import Children, Stopped
from remote_tpu_agent.worker.run import WorkerRun

log = logging.getLogger(__name__)


def pin(host: Host, spec: pb.JobSpec) -> tuple[list[str] | None, str]:
    """Pin the call's large buffers on ``host`` (the gateway made sure it had
    them just before): their paths, or None and why not."""
    paths = host.blobs.pin(refs_of(spec))
    if paths is not None:
        return paths, ""
    too_small = host.blobs.too_small(refs_of(spec))
    if too_small:
        return None, f"host {host.endpoint()}: {too_small}"
    missing = len(host.blobs.missing(refs_of(spec)))
    return None, (f"host {host.endpoint()} lacks {missing} of the call's large "
                  "argument buffers (its argument cache evicted them): call again")


class PeerCall:
    """This host's part of one gateway call (a warm session's calls included).

    Why over 200 lines (near 300, a third of it docstrings): one call's life (prepared,
    run, a warm session's next calls on gRPC or on the lane) whose methods,
    run by four threads, share its state; split, that state would be passed
    around again as it was before this class.

    ``pinned``: the current call's large buffers pinned here; the caller
    unpins what is left in it once ``events()`` is over. ``runs``: where the
    worker run is registered while it lives (for ``Stacks``)."""

    def __init__(self, host: Host, spec: pb.JobSpec, payload: bytes | str,
                 requests: Iterator[pb.RunRequest], record: JobRecord,
                 context: grpc.ServicerContext, blob_paths: list[str],
                 pinned: list[pb.BlobRef], runs: dict[tuple[str, int], WorkerRun]) -> None:
        self._host = host
        self._spec = spec
        self._payload = payload
        self._requests = requests
        self._record = record
        self._context = context
        self._blob_paths = blob_paths
        self.pinned = pinned
        self._runs = runs
        self._queue = EventQueue()
        self._children = Children()
        self._gate = threading.Lock()           # a cancel, and the worker's start
        self._run: WorkerRun | None = None
        self._outputs = self._output_sync(spec)   # the current call's
        self._on_lane = False                   # the current call came on the lane
        self._lane = self._new_lane()
        self._final = pb.JOB_PHASE_LOST         # the record's phase once it is over

    # -- the call's own thread ------------------------------------------------

    def events(self) -> Iterator[pb.Event]:
        """The events to send on the gateway's gRPC call, until it is over."""
        spec = self._spec
        self._context.add_callback(self._on_done)
        threading.Thread(target=self._obey, daemon=True, name="peer-control").start()
        log.info("job %s: host %d, coordinator %s", spec.job_id, spec.process_id,
                 spec.coordinator_address)
        try:
            yield from self._started()
            if self._run is not None:
                yield from self._relay()
        finally:
            self._lane.close()
            self._outputs.finish()
            self._queue.close()
            self._children.stop("the call is over")
            if self._run is not None:
                self._end_run()
            self._host.tpu.release()
            self._record.set_phase(self._final, "" if self._final != pb.JOB_PHASE_LOST else
                                   "the gateway went away before this host finished")

    def _started(self) -> Iterator[pb.Event]:
        """Prepare the call (what the installer says: sent as it comes) and
        start its worker; where it could not be, the host's end."""
        spec = self._spec
        made = yield from prepare_saying(
            lambda say: self._prepare(spec, self._payload, self._blob_paths, say,
                                      self._children),
            self._children, self._queue, lambda line: _said(spec.process_id, self._record,
                                                           line))
        with self._gate:
            if isinstance(made, Call) and not self._children.stopped:
                self._run = self._start(made)
        if isinstance(made, Call) and self._run is None:        # cancelled as it was made
            made = Stopped(self._children.stopped)
        if isinstance(made, BaseException):
            end = self._unplaced(spec.process_id, made)
            yield end
            self._final = phase_of_host(end.exited.state)

    def _relay(self) -> Iterator[pb.Event]:
        """The worker's events (and a warm session's next calls' on gRPC),
        until the call is over."""
        while (event := self._queue.get()) is not None:
            if isinstance(event, _Kept):      # dealt with: only to send
                yield from self._deliver(event.event)
                continue
            if event.HasField("output"):
                self._keep(event)
            if event.HasField("exited") and event.exited.state != pb.HOST_STATE_SUCCEEDED:
                event.exited.preempted = self._host.preempted()
            if event.HasField("done") and event.done.warm:
                continue        # the worker parked: its `exited` (warm) says it all
            if event.HasField("done") or event.HasField("exited"):
                report = event.done if event.HasField("done") else event.exited
                report.notices.extend(self._outputs.finish())   # saved before it reports
            if event.HasField("exited") and event.exited.warm:
                yield from self._parked(event)
            yield from self._deliver(event)
            if event.HasField("exited"):
                self._final = (pb.JOB_PHASE_PREEMPTED if event.exited.preempted
                               else phase_of_host(event.exited.state))
                if not event.exited.warm:
                    return
                # Warm: the session's next call comes on gRPC (``_obey``: its
                # events then come here) or on the lane (``_direct``).

    def _parked(self, event: pb.Event) -> Iterator[pb.Event]:
        """The worker parked after a call: offer the lane for the session's
        next calls (after a call on gRPC), and unpin the call's buffers before
        the gateway hears of it (and may send the next call)."""
        if not self._on_lane:
            if self._lane.ended:          # broke between calls (this one came on gRPC)
                self._lane = self._new_lane()
            if not self._lane.offered and (offer := self._lane.offer(self._host.data_port())):
                yield pb.Event(host=event.host, lane=offer)
        self._unpin()                         # its worker has them mapped

    def _deliver(self, event: pb.Event) -> Iterator[pb.Event]:
        """Send an event back the way its call came (yielded: on the gRPC
        call, also where the lane is gone)."""
        if not (self._on_lane and self._lane.send(event)):
            yield event

    # -- other threads ----------------------------------------------------------

    def _keep(self, event: pb.Event) -> None:
        """This host's own copy of an output event."""
        try:
            self._record.append_output(event.host, event.output.stream, event.output.data)
        except StoreFull as exc:
            log.error("job %s: %s", self._spec.job_id, exc.strerror)

    def _direct(self, event: pb.Event) -> None:
        """A lane call's events, sent on the lane by the thread that made them
        (the worker's output and status readers; each waits for the ones
        before it: ``WorkerRun``). What ends the session goes to this call's
        own thread."""
        if event.HasField("output"):
            self._keep(event)
        elif event.HasField("result_size") or event.HasField("result_chunk"):
            pass                # (all_results=: sent in order, before the `exited`)
        elif event.HasField("done") and event.done.warm:
            return              # the worker parked: its `exited` (warm) says it all
        elif event.HasField("exited") and event.exited.warm:
            event.exited.notices.extend(self._outputs.finish())   # saved before it reports
            self._unpin()                       # before the gateway can send the next
        else:
            self._queue.put(event)
            return
        if not self._lane.send(event):
            self._queue.put(_Kept(event))       # the lane is gone: on gRPC

    def _said_back(self, event: pb.Event) -> None:
        """An event of the agent's own about the current call, sent the way
        the call came."""
        if not (self._on_lane and self._lane.send(event)):
            self._queue.put(_Kept(event))

    def _lane_call(self, next_spec: pb.JobSpec) -> None:
        data = next_spec.payload
        next_spec.ClearField("payload")       # (the worker checks its digest)
        self._next_call(next_spec, data, came_on_lane=True)

    def _new_lane(self) -> PeerLane:
        return PeerLane(self._lane_call, lambda: threading.Thread(
            target=self.cancel, daemon=True).start())

    def cancel(self, why: str = "cancelled by its gateway", end: bool = False) -> None:
        """Stop the call's preparation, and its worker's call (``end``: the
        worker itself)."""
        with self._gate:
            self._children.stop(why)
            started = self._run
        if started is not None and end:
            started.stop()
        elif started is not None:
            started.cancel()

    def _obey(self) -> None:
        """The gateway's controls, and a warm session's next calls on gRPC."""
        try:
            for req in self._requests:
                kind = req.WhichOneof("kind")
                run = self._run
                if kind == "next_call" and run is not None and run.warm:
                    data = self._host.uploads.receive(
                        req.next_call, self._requests,
                        os.path.join(self._record.dir, _worker.PAYLOAD_FILE), self._context)
                    self._next_call(req.next_call, data, came_on_lane=False)
                elif req.control == pb.CONTROL_RELEASE and run is not None:
                    run.release()
                elif req.control == pb.CONTROL_CANCEL:
                    threading.Thread(target=self.cancel, daemon=True).start()
                elif req.control == pb.CONTROL_INTERRUPT and run is not None:
                    run.interrupt()
                else:
                    log.warning("job %s: ignoring unexpected request %s", self._spec.job_id,
                                kind or f"control {req.control}")
        except grpc.RpcError:
            pass
        except Exception:  # noqa: BLE001 - the stream ended under us
            log.debug("control stream ended", exc_info=True)
        finally:
            self._queue.put(None)

    def _on_done(self) -> None:
        """The gateway's call is over: so is the worker."""
        self._lane.close()
        threading.Thread(target=self.cancel, args=("the gateway's call ended", True),
                         daemon=True).start()
        self._queue.put(None)

    # -- a warm session's next call ----------------------------------------------

    def _next_call(self, spec: pb.JobSpec, payload: bytes | str, came_on_lane: bool) -> None:
        """Hand the session's next call to the parked worker, in the thread
        that received it (no hand-off on the way). What preparing it said goes
        back first; so does why it could not start, and the session then ends
        (its events end too)."""
        self._on_lane = came_on_lane
        run = self._run
        paths, why = pin(self._host, spec)
        if paths is None:
            self._end_session(pb.Event(host=run.host, exited=pb.HostReport(
                host=run.host, state=pb.HOST_STATE_LOST, finished_at=time.time(),
                detail=why)))
            return
        self._unpin()                           # the last call's: its worker mapped them
        self.pinned[:] = refs_of(spec)
        try:                                    # (the session's own environment: made)
            call = self._prepare(spec, payload, paths,
                                 lambda line: self._said_back(_said(run.host, self._record,
                                                                    line)),
                                 Children())
        except (NotPrepared, Stopped) as exc:
            self._end_session(self._unplaced(run.host, exc))
            return
        self._outputs = self._output_sync(spec)
        if not run.next_call(call, self._direct if came_on_lane else self._queue.put):
            self._end_session(pb.Event(host=run.host, exited=pb.HostReport(
                host=run.host, state=pb.HOST_STATE_DIED, exited=True,
                detail="its warm worker had exited since the last call")))

    def _end_session(self, event: pb.Event) -> None:
        self._said_back(event)
        self._queue.put(None)

    # -- helpers ---------------------------------------------------------------------

    def _prepare(self, spec: pb.JobSpec, payload: bytes | str, blob_paths: list[str],
                 say: Callable[[str], None], children: Children) -> Call:
        """The worker's call: its trees placed here first, its environment made
        (its installer's lines to ``say``, its processes as ``children``).
        NotPrepared, Stopped."""
        host = self._host
        try:
            call_paths, working_dir, data = place_job(host.workdirs, spec, blob_paths)
            env = {**host.env_for(spec, spec.process_id, spec.coordinator_address),
                   **host.envs.for_job(spec, host.simulated, say, children)}
        except (OSError, ValueError, EnvError) as exc:
            raise NotPrepared(f"host {host.endpoint()} could not prepare the call: "
                              f"{exc}") from exc
        return Call(job_dir=self._record.dir, payload=payload,
                    digest=spec.payload_digest.hex(), env=env, blobs=call_paths,
                    working_dir=working_dir, data=data, gcs_data=list(spec.gcs_data),
                    stall_after=spec.stall_after_seconds)

    def _unplaced(self, host: int, exc: BaseException) -> pb.Event:
        """The host's end when its call could not be prepared, or was stopped."""
        stopped = isinstance(exc, Stopped)
        return pb.Event(host=host, exited=pb.HostReport(
            host=host, state=pb.HOST_STATE_CANCELLED if stopped else pb.HOST_STATE_FAILED,
            exited=True, finished_at=time.time(), detail=(
                f"host {self._host.endpoint()} stopped preparing the call: {exc}"
                if stopped else str(exc))))

    def _start(self, call: Call) -> WorkerRun:
        """Start the call's worker, its events to the queue."""
        spec = self._spec
        run = WorkerRun(host=spec.process_id, call=call, emit=self._queue.put,
                        forward_output=True, warm=spec.keep_warm_seconds > 0,
                        spares=self._host.spares, emit_value=True)
        # A parked worker that dies ends the call, so its gateway knows the
        # session is over (its last `exited` event was the warm one).
        run.on_parked_exit = lambda: self._queue.put(None)
        self._runs[(spec.job_id, spec.process_id)] = run
        run.start()
        return run

    def _end_run(self) -> None:
        """The call is over: its worker too (what it printed while parked kept)."""
        run = self._run
        if run.parked:              # printed since the session's last call: kept here
            for stream, data in run.parked_output():
                try:
                    self._record.append_output(run.host, stream, data)
                except StoreFull:
                    break
        run.stop()
        run.finished.wait(5)
        self._runs.pop((self._spec.job_id, self._spec.process_id), None)

    def _output_sync(self, spec: pb.JobSpec) -> OutputSync:
        return OutputSync(spec, self._host.store.state_dir, [spec.process_id],
                          self._record.say, self._host.output_interval).start()

    def _unpin(self) -> None:
        self._host.blobs.unpin(self.pinned)
        self.pinned.clear()


class _Kept:
    """An event already dealt with here, for the call's thread only to send."""

    __slots__ = ("event",)

    def __init__(self, event: pb.Event) -> None:
        self.event = event


def _said(host: int, record: JobRecord, line: str) -> pb.Event:
    """What the agent itself said for this host (an installer's output), as
    the host's stderr: kept here, and sent to the gateway."""
    return pb.Event(host=host, output=pb.Output(stream=pb.OUTPUT_STREAM_STDERR,
                                                data=record.say(host, line)))
