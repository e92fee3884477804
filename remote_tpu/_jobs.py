"""Jobs that outlive the call: handles, attach, listing."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from ._auth import TLS
from ._cloud import is_tpu_url
from ._cloud import resolve as resolve_tpu
from ._exceptions import ConfigurationError, JobTimeoutError, RemoteTPUError
from ._options import LOCAL, parse_hosts
from ._proto import remote_tpu_pb2 as pb
from ._proto import remote_tpu_pb2_grpc as pb_grpc
from ._render import OutputRenderer
from ._topology import Topology
from ._transport import Credentials, error_from_rpc, shared_channel

STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT", "LOST",
          "PREEMPTED")
FINISHED = frozenset(STATES[2:])


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """Where a job stands. ``state`` is one of QUEUED, RUNNING, SUCCEEDED,
    FAILED, CANCELLED, TIMED_OUT, LOST, PREEMPTED."""

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

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @classmethod
    def from_pb(cls, s: pb.JobStatus) -> JobStatus:
        return cls(id=s.job_id, state=pb.JobPhase.Name(s.phase).removeprefix("JOB_PHASE_"),
                   accelerator=s.accelerator, hosts=s.num_hosts, created_at=s.created_at,
                   started_at=s.started_at or None, ended_at=s.ended_at or None,
                   detail=s.detail, queued_behind=s.queued_behind or None,
                   queue_position=s.queue_position or None)


class JobHandle:
    """A job on a slice, whether this process started it or not.

    ``remote_tpu.attach(job_id, hosts=...)`` makes one in any process that can
    reach the gateway and holds the slice's token.
    """

    def __init__(self, job_id: str, *, gateway: str, credentials: Credentials,
                 accelerator: str = "", local: bool = False) -> None:
        self._id = job_id
        self._gateway = gateway
        self._credentials = credentials
        self._accelerator = accelerator
        self._local = local
        self._stub = pb_grpc.AgentStub(shared_channel(gateway, credentials))

    @property
    def id(self) -> str:
        return self._id

    def __repr__(self) -> str:
        return f"<remote_tpu.JobHandle {self._id} at {self._gateway}>"

    def _call(self, method: str, request: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, metadata=self._credentials.metadata,
                                               **kwargs)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _error(self, exc: grpc.RpcError) -> RemoteTPUError:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return RemoteTPUError(f"{exc.details()}. Check the job id and hosts=.")
        err = error_from_rpc(exc, self._gateway)
        if self._local and exc.code() == grpc.StatusCode.UNAVAILABLE:
            return RemoteTPUError(f"{err} (a local slice lives only as long as the process "
                                  "that started it)")
        return err

    def status(self) -> JobStatus:
        return JobStatus.from_pb(self._call("Status", pb.JobRef(job_id=self._id), timeout=30))

    def _accelerator_name(self) -> str:
        if not self._accelerator:
            self._accelerator = self.status().accelerator
        return self._accelerator

    def logs(self, host: int | None = None, follow: bool = False) -> str | Iterator[str]:
        """Host ``host``'s output (default: process 0, the leader), stdout and
        stderr interleaved as written. With ``follow``, an iterator of text as
        it comes, until the job ends."""
        if host is not None and (isinstance(host, bool) or not isinstance(host, int)
                                 or host < 0):
            raise ConfigurationError(f"host= must be a host index (0, 1, ...), got {host!r}")
        request = pb.WatchRequest(job_id=self._id, hosts=[host or 0], follow=follow)
        texts = self._texts(request)
        return texts if follow else "".join(texts)

    def _texts(self, request: pb.WatchRequest) -> Iterator[str]:
        import codecs
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stream = self._stub.Watch(request, metadata=self._credentials.metadata)
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

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the job has ended (or ``timeout`` seconds); its status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        request = pb.WatchRequest(job_id=self._id, hosts=[0], offsets=[1 << 62], follow=True)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                for _ in self._stub.Watch(request, metadata=self._credentials.metadata,
                                          timeout=left):
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
        from ._client import outcome

        self.wait(timeout)
        stream = self._stub.Result(pb.JobRef(job_id=self._id),
                                   metadata=self._credentials.metadata)
        return outcome(stream, OutputRenderer("none"), gateway=self._gateway, job_id=self._id,
                       accelerator=self._accelerator_name())

    def cancel(self) -> JobStatus:
        """Stop the job on every host (a queued job simply leaves the queue)."""
        self._call("Cancel", pb.JobRef(job_id=self._id), timeout=30)
        return self.wait(30)

    def stacks(self) -> dict[int, str]:
        """Every host's worker stack now: which host is stuck where."""
        reply = self._call("Stacks", pb.JobRef(job_id=self._id), timeout=30)
        return {h.host: h.text for h in reply.hosts}


def _gateway(hosts: str | Sequence[str] | None, token: str | None,
             tls: TLS | None) -> tuple[str, Credentials]:
    addresses = parse_hosts(hosts, Topology.parse("tpu-v5litepod-1"), check_count=False)
    if is_tpu_url(addresses[0]):
        addresses = tuple(resolve_tpu(addresses[0])[0])
    if addresses == (LOCAL,):
        raise ConfigurationError(
            "a local slice lives only as long as the process that started it: use the "
            "JobHandle that submit() returned there, or run agents with "
            "`remote-tpu local` / `remote-tpu-agent` and pass their addresses as hosts=")
    return addresses[0], Credentials.for_client(token, tls)


def attach(job_id: str, hosts: str | Sequence[str] | None = None, *, token: str | None = None,
           tls: TLS | None = None) -> JobHandle:
    """The handle of a job started elsewhere (another process, another machine)."""
    gateway, credentials = _gateway(hosts, token, tls)
    handle = JobHandle(job_id, gateway=gateway, credentials=credentials)
    handle._accelerator = handle.status().accelerator     # fails now if there is no such job
    return handle


def jobs(hosts: str | Sequence[str] | None = None, *, token: str | None = None,
         tls: TLS | None = None, limit: int = 0) -> list[JobStatus]:
    """The jobs the gateway knows, newest first."""
    gateway, credentials = _gateway(hosts, token, tls)
    with credentials.channel(gateway) as channel:
        try:
            reply = pb_grpc.AgentStub(channel).ListJobs(
                pb.ListJobsRequest(limit=limit), metadata=credentials.metadata, timeout=30)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, gateway) from None
    if reply.omitted:
        warnings.warn(f"the agent at {gateway} left out its {reply.omitted} oldest jobs to keep "
                      "its reply small: pass limit= to list fewer, newest first", stacklevel=2)
    return [JobStatus.from_pb(s) for s in reply.jobs]
