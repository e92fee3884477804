"""Jobs that outlive the call: handles, attach, listing."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from . import _call_lane as call_lane
from ._core import data_wire
from ._core.auth import TLS
from ._core.channels import error_from_rpc, forget_if_unavailable
from ._core.exceptions import ConfigurationError, JobTimeoutError
from ._core.proto import remote_tpu_pb2 as pb
from ._core.states import FINISHED_NAMES, phase_name
from ._core.user_source import cut_sdk_frames
from ._futures import AsFuture, of_the_job, tag_job
from ._outcome import outcome, result_request
from ._render import OutputRenderer
from ._target import Target, resolve_target, running_targets


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of a job under ``retries=`` that ended and was tried again:
    its number (0 = the first), the job it ran as, how it ended (state,
    ``kind``: "preemption" or "failure", ``cause``: why, in one line), the
    host at its root, and when it ended."""

    number: int
    job_id: str
    state: str
    kind: str
    cause: str
    root_cause_host: int | None
    started_at: float | None
    ended_at: float | None

    @classmethod
    def from_pb(cls, a: pb.Attempt) -> Attempt:
        return cls(number=a.number, job_id=a.job_id,
                   state=pb.JobState.Name(a.state).removeprefix("JOB_STATE_"), kind=a.kind,
                   cause=a.cause,
                   root_cause_host=a.root_cause_host if a.root_cause_host >= 0 else None,
                   started_at=a.started_at or None, ended_at=a.ended_at or None)


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """Where a job stands. ``state`` is one of QUEUED, RUNNING, SUCCEEDED,
    FAILED, CANCELLED, TIMED_OUT, LOST, PREEMPTED, or WARM: a slice's warm
    workers between calls (``keep_warm``), kept until ``warm_until``."""

    id: str
    state: str
    accelerator: str
    hosts: int
    created_at: float
    started_at: float | None
    ended_at: float | None
    detail: str
    queued_behind: str | None
    queue_position: int | None
    warm_until: float | None = None
    attempts: tuple[Attempt, ...] = ()      # retries=: the attempts that ended before
    slices: int = 1                         # num_slices=: hosts counts every slice's

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_NAMES

    @classmethod
    def from_pb(cls, s: pb.JobStatus) -> JobStatus:
        warm = s.warm_until > 0 and s.phase == pb.JOB_PHASE_RUNNING
        return cls(id=s.job_id, state="WARM" if warm else phase_name(s.phase),
                   warm_until=s.warm_until if warm else None,
                   accelerator=s.accelerator, hosts=s.num_hosts, created_at=s.created_at,
                   started_at=s.started_at or None, ended_at=s.ended_at or None,
                   detail=s.detail, queued_behind=s.queued_behind or None,
                   queue_position=s.queue_position or None,
                   attempts=tuple(Attempt.from_pb(a) for a in s.attempts),
                   slices=max(1, s.num_slices))


class JobHandle(AsFuture):
    """A job on a slice, whether this process started it or not.

    ``remote_tpu.attach(job_id, hosts=...)`` makes one in any process that can
    reach the gateway and holds the slice's token.

    It answers as a ``concurrent.futures.Future`` does (``done``, ``running``,
    ``cancelled``, ``result``, ``exception``, ``add_done_callback``) without
    being one: ``future()`` is a real one, for ``concurrent.futures.wait`` and
    ``as_completed``. ``await handle`` waits in a thread, not blocking the
    event loop. ``cancel()`` stops the job on every host, as before.
    """

    def __init__(self, job_id: str, target: Target, *, accelerator: str = "",
                 output_dir: str = "") -> None:
        self._id = job_id
        self._target = target
        self._accelerator = accelerator
        self._output_dir = output_dir

    def outputs(self, to: str | None = None) -> list[str]:
        """The job's output files (``output_dir=``): its objects' gs:// URIs, or,
        for a local directory, the files once brought from every host to
        ``{output_dir}/{job_id}/`` (the job must have finished). ``to``: the
        job's output_dir, for a handle from ``attach`` (which does not know it)."""
        from . import _output_files

        where = to or self._output_dir
        if not where:
            raise ConfigurationError(f"job {self._id}: this handle does not know the job's "
                                     "output_dir; pass it: handle.outputs(to='gs://...' or a "
                                     "local directory)")
        if where.startswith("gs://"):
            return _output_files.list_gcs(where, self._id)
        return _output_files.collect(self._target, self._id, os.path.abspath(where))

    @property
    def id(self) -> str:
        return self._id

    def __repr__(self) -> str:
        return f"<remote_tpu.JobHandle {self._id} at {self._target.gateway}>"

    def _call(self, method: str, request: Any, **kwargs: Any) -> Any:
        return self._target.call(lambda t: getattr(t.stub(), method)(
            request, metadata=t.credentials.metadata, **kwargs))

    def _error(self, exc: grpc.RpcError) -> Exception:
        forget_if_unavailable(exc, self._target.gateway, self._target.credentials)
        return self._target.explain(error_from_rpc(exc, self._target.gateway))

    def _stream(self, method: str, request: Any, **kwargs: Any) -> Any:
        """A streaming call, not retried nor redirected: the handle's target is
        already the job's gateway (submit and attach went there first)."""
        return getattr(self._target.stub(), method)(
            request, metadata=self._target.credentials.metadata, **kwargs)

    def status(self) -> JobStatus:
        return JobStatus.from_pb(self._status_reply())

    def _status_reply(self) -> pb.JobStatus:
        """The agent's reply itself: a finished job's with its ``end`` report."""
        return self._call("Status", pb.JobRef(job_id=self._id), timeout=30)

    def _accelerator_name(self) -> str:
        if not self._accelerator:
            self._accelerator = self.status().accelerator
        return self._accelerator

    def logs(self, host: int | str | None = None, follow: bool = False,
             since: float | None = None) -> str | Iterator[str]:
        """Host ``host``'s output (default: process 0, the leader), stdout and
        stderr interleaved as written; ``host="all"``: every host's (every
        process's, with several per host), each line prefixed ``[host i] ``,
        merged in the order the gateway stored them (one clock for all).
        ``since``: only what was stored from then on (seconds since the epoch,
        as ``time.time()``). With ``follow``, an iterator of text as it comes,
        until the job ends."""
        if since is not None and (isinstance(since, bool) or
                                  not isinstance(since, (int, float))):
            raise ConfigurationError(f"since= must be a time in seconds since the epoch "
                                     f"(time.time() - 600: the last ten minutes), got {since!r}")
        if host == "all":
            texts = every_log(self, follow, since or 0.0)
            return texts if follow else "".join(texts)
        if host is not None and (isinstance(host, bool) or not isinstance(host, int)
                                 or host < 0):
            raise ConfigurationError(f"host= must be a host index (0, 1, ...) or \"all\", "
                                     f"got {host!r}")
        request = pb.WatchRequest(job_id=self._id, hosts=[host or 0], follow=follow,
                                  since=since or 0.0)
        texts = self._texts(request)
        return texts if follow else "".join(texts)


    def _texts(self, request: pb.WatchRequest) -> Iterator[str]:
        import codecs
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stream = self._stream("Watch", request)
        try:
            for event in stream:
                if event.HasField("output"):
                    text = decoder.decode(event.output.data)
                    if text:
                        yield text
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            stream.cancel()
        rest = decoder.decode(b"", final=True)
        if rest:
            yield rest

    def _outputs(self, hosts: Sequence[int], offsets: Sequence[int] = (),
                 follow: bool = False, merged: bool = False, since: float = 0.0
                 ) -> Iterator[tuple[int, bytes, int, float]]:
        """Each output of the hosts' logs as the agent sends it: (host, bytes,
        the host's log offset after them, when the gateway stored them), from
        ``offsets`` (default 0); ``merged``: in time order; ``since``: what was
        stored from then on."""
        request = pb.WatchRequest(job_id=self._id, hosts=list(hosts), offsets=list(offsets),
                                  follow=follow, merged=merged, since=since)
        stream = self._stream("Watch", request)
        try:
            for event in stream:
                if event.HasField("output"):
                    out = event.output
                    yield event.host, out.data, out.offset, out.time
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            stream.cancel()

    def _has_log(self, index: int) -> bool:
        """Whether the job has a log ``index`` (one per process: with
        processes_per_host, more than its hosts); reads none of it."""
        request = pb.WatchRequest(job_id=self._id, hosts=[index], offsets=[1 << 62])
        stream = self._stream("Watch", request, timeout=30)
        try:
            for _ in stream:
                pass
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return False
            raise self._error(exc) from None
        return True

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the job has ended (or ``timeout`` seconds); its status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        request = pb.WatchRequest(job_id=self._id, hosts=[0], offsets=[1 << 62], follow=True)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                for _ in self._stream("Watch", request, timeout=left):
                    pass
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    time.sleep(min(0.5, left or 0.5))    # the agent's streams are all
                elif exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:   # taken: poll
                    raise self._error(exc) from None
            status = self.status()
            if status.finished:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeoutError(f"job {self._id} is still {status.state} after "
                                      f"{timeout:g} s (it keeps running; cancel() stops it)")

    def result(self, timeout: float | None = None) -> Any:
        """The value process 0 returned, or the remote exception re-raised, as
        for a blocking call. Can be asked again."""
        __tracebackhide__ = True
        future = self._future
        try:
            if future is not None and future.done() and of_the_job(future):
                return future.result()      # fetched already, by the watching thread
            return self._result(timeout)
        except (Exception, KeyboardInterrupt) as exc:
            raise cut_sdk_frames(tag_job(exc, self._id))

    def _result(self, timeout: float | None) -> Any:
        if self.status().warm_until is not None:     # said at once, not after the session
            raise ConfigurationError(
                f"{self._id} is a warm session's entry: it has no value of its own (each "
                "call in it has its own job and value)")
        self.wait(timeout)
        port = data_wire.worth_trying(self._target.gateway, self._target.credentials)
        stream = self._stream("Result", result_request(self._id, data_port=port))
        return outcome(stream, OutputRenderer("none"), gateway=self._target.gateway,
                       job_id=self._id, accelerator=self._accelerator_name(),
                       refetch=lambda: self._stream("Result", result_request(self._id)))

    def cancel(self) -> JobStatus:
        """Stop the job on every host (a queued job simply leaves the queue);
        its status once ended: CANCELLED, or how it had ended before. Unlike
        ``Future.cancel()``, not a bool: a running job is cancelled too."""
        self._call("Cancel", pb.JobRef(job_id=self._id), timeout=30)
        return self.wait(30)

    def metrics(self) -> list[dict]:
        """Every process's metrics now, while the job runs (empty once it has
        ended): ``host``, ``state``, ``step`` (the last
        ``remote_tpu.progress(step=)``, if any) and ``steps_per_second``,
        ``cpu_percent`` (of one core), ``rss_bytes``,
        ``output_bytes_per_second``, ``tpu`` (``duty_cycle_percent``,
        ``hbm_used_bytes``, ``hbm_total_bytes``, or a ``note`` saying why
        there are none) and ``updated_at``: what ``remote-tpu top`` shows."""
        from ._top import metrics_dicts
        return metrics_dicts(self._status_reply().metrics)

    def stacks(self) -> dict[int, str]:
        """Every host's worker stack now: which host is stuck where."""
        reply = self._call("Stacks", pb.JobRef(job_id=self._id), timeout=30)
        return {h.host: h.text for h in reply.hosts}


def attach(job_id: str, hosts: str | Sequence[str] | None = None, *, token: str | None = None,
           tls: TLS | None = None) -> JobHandle:
    """The handle of a job started elsewhere (another process, another machine)."""
    handle = JobHandle(job_id, resolve_target(hosts, token=token, tls=tls))
    handle._accelerator = handle.status().accelerator     # fails now if there is no such job
    return handle


def jobs(hosts: str | Sequence[str] | None = None, *, token: str | None = None,
         tls: TLS | None = None, limit: int = 0) -> list[JobStatus]:
    """The jobs the gateway knows, newest first."""
    target = resolve_target(hosts, token=token, tls=tls)
    reply = target.call(lambda t: t.stub().ListJobs(
        pb.ListJobsRequest(limit=limit), metadata=t.credentials.metadata, timeout=30))
    if reply.omitted:
        warnings.warn(f"the agent at {target.gateway} left out its {reply.omitted} oldest "
                      "jobs to keep its reply small: pass limit= to list fewer, newest first",
                      stacklevel=2)
    return [JobStatus.from_pb(s) for s in reply.jobs]


def release(hosts: str | Sequence[str] | None = None, *, token: str | None = None,
            tls: TLS | None = None) -> bool:
    """End the warm workers (``keep_warm``) of the slice behind ``hosts`` now,
    whoever's they are; whether there were any. ``hosts="local"``: every local
    slice this process runs."""
    return any(released for released, _ in release_targets(
        running_targets(hosts, token=token, tls=tls)))


def release_targets(targets: Sequence[Target]) -> list[tuple[bool, str]]:
    """Ask each slice to end its warm workers: (whether it had any, what it did)."""
    replies = [target.call(lambda t: t.stub().Release(
        pb.ReleaseRequest(), metadata=t.credentials.metadata, timeout=60))
        for target in targets]
    for target in targets:
        call_lane.close(target.gateway)
    return [(reply.released, reply.detail) for reply in replies]


def every_log(handle: JobHandle, follow: bool, since: float) -> Iterator[str]:
    """Every log of the job's, each line prefixed with its host (or process)."""
    import io

    from ._render import LogPrinter

    hosts = handle.status().hosts
    count = log_count(handle, hosts)
    word = "host" if count == max(1, hosts) else "process"
    out = io.StringIO()
    printer = LogPrinter(out, lambda h: f"[{word} {h}] ")

    def taken() -> str:
        text = out.getvalue()
        out.seek(0)
        out.truncate()
        return text
    for h, data, _, _ in handle._outputs(range(count), follow=follow, merged=not follow,
                                       since=since):
        printer.write(h, data)
        if text := taken():
            yield text
    for h in range(count):
        printer.end(h)
    if text := taken():
        yield text


def log_count(handle: JobHandle, hosts: int) -> int:
    """How many logs the job has: one per process, ``hosts`` unless it ran
    several processes per host (found by asking for logs past the hosts')."""
    hosts = max(1, hosts)
    per_host = 1
    while per_host < 64 and handle._has_log(hosts * per_host):
        per_host += 1
    return hosts * per_host
