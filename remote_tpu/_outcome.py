"""A job's events -> its output shown, then the value, or the exception the caller sees."""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ._core import data_wire, digests, value_list
from ._core.channels import error_from_rpc
from ._core.exceptions import (AgentUnavailableError, JobFailedError, JobTimeoutError,
                               RemoteError, RemoteTraceback, SerializationError)
from ._core.proto import remote_tpu_pb2 as pb
from ._core.serialization import loads
from ._core.remote_exceptions import rebuild_exception
from ._core.states import HOST_STATE_WORDS
from ._render import OutputRenderer
from ._status import LiveStatus

def host_name(h: int, per_slice: int = 0, label: str = "host") -> str:
    """``host 3``; in a job on several slices ``host 3 (slice 1 host 1)``
    (``per_slice``: its hosts, or processes, per slice)."""
    return f"{label} {h} (slice {h // per_slice} {label} {h % per_slice})" if per_slice \
        else f"{label} {h}"


def describe_hosts(reports: Sequence[pb.HostReport], per_slice: int = 0,
                   label: str = "host") -> str:
    lines = []
    for r in reports:
        words = HOST_STATE_WORDS.get(r.state, "unknown")
        detail = f" ({r.detail})" if r.detail else ""
        lines.append(f"  {host_name(r.host, per_slice, label)}: {words}{detail}")
    return "\n".join(lines)


def _last_lines(report: pb.HostReport) -> str:
    if not report.last_lines:
        return "  (no output)"
    return "\n".join(f"  | {line}" for line in report.last_lines)


def raise_for_end(end: pb.JobEnd, *, accelerator: str, job_id: str,
                  label: str = "host") -> None:
    """Return if the job succeeded, else raise what the caller should see
    (``label``: "process" when a host runs several)."""
    if end.state == pb.JOB_STATE_SUCCEEDED:
        return
    per_slice = len(end.hosts) // end.num_slices if end.num_slices > 1 else 0
    if end.num_slices > 1:
        accelerator = f"{end.num_slices} slices of {accelerator}"
    hosts = describe_hosts(end.hosts, per_slice, label) or "  (none: nothing ran)"
    where = f"{accelerator}, job {job_id}"
    if end.state == pb.JOB_STATE_TIMED_OUT:
        stacks = "".join(f"\n===== host {r.host} =====\n{r.stacks.rstrip()}\n"
                         for r in end.hosts if r.stacks)
        raise JobTimeoutError(f"job {job_id} on {accelerator} {end.detail}; every host was "
                              f"stopped. Final state of each host:\n{hosts}"
                              + (f"\nWhere each host was at the timeout:{stacks}"
                                 if stacks else ""), hosts=end.hosts)
    if end.state == pb.JOB_STATE_PREEMPTED:
        raise JobFailedError(f"job {job_id} on {accelerator} ended: {end.detail}. Final state "
                             f"of each host:\n{hosts}", host=end.root_cause_host,
                             hosts=end.hosts)
    if end.state == pb.JOB_STATE_LOST:
        raise JobFailedError(f"job {job_id} on {accelerator} was lost: {end.detail}",
                             hosts=end.hosts)
    if end.state == pb.JOB_STATE_CANCELLED:
        raise JobFailedError(f"job {job_id} on {accelerator} was cancelled: "
                             f"{end.detail or 'no reason given'}. Final state of each "
                             f"host:\n{hosts}", hosts=end.hosts)
    if end.root_cause_host < 0 or end.root_cause_host >= len(end.hosts):
        detail = end.detail or "no host reported a cause"
        raise JobFailedError(f"job {job_id} on {accelerator} failed: {detail}. Final state "
                             f"of each host:\n{hosts}", hosts=end.hosts)
    h = end.root_cause_host
    root = end.hosts[h]
    n = len(end.hosts)
    name = host_name(h, per_slice, label)
    if root.state == pb.HOST_STATE_FAILED and root.exception.type_name:
        info = root.exception
        cause = RemoteTraceback(f"\nTraceback on {name} of {n} ({where}):\n"
                                f"{info.traceback.rstrip()}")
        exc = rebuild_exception(info.pickled)
        if isinstance(exc, Exception):
            try:
                exc.add_note(f"raised on {name} of {n} ({where}). Final state of each "
                             f"host:\n{hosts}" + (f"\n{end.detail}" if end.detail else ""))
                hint = local_hint(exc)
                if hint:
                    exc.add_note(hint)
                exc.remote_host = h  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            raise exc from cause
        raise RemoteError(
            f"{name} of {n} raised {info.type_name}: {info.message} (the exception "
            f"could not be rebuilt here; its traceback is below). Final state of each "
            f"host:\n{hosts}",
            type_name=info.type_name, remote_traceback=info.traceback, host=h) from cause
    also = f" The agent adds: {end.detail}. " if end.detail else " "
    if "\n" in end.detail:                 # (a table: on lines of its own)
        also = f"\nThe agent adds: {end.detail.rstrip()}\n"
    raise JobFailedError(
        f"{name} of {n} ({where}) {root.detail or HOST_STATE_WORDS.get(root.state, 'failed')}."
        f"{also}Final state of each host:\n{hosts}\nLast output of {name}:\n"
        f"{_last_lines(root)}", host=h, hosts=end.hosts)


# Directories where the user's own files may be besides the current one (the
# command line adds the script's).
LOOK_IN: list[str] = []


def local_hint(exc: BaseException) -> str:
    """What to do when a host lacks a file or module that this machine has:
    the usual mistake of a first call; "" when it does not apply."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.partition(".")[0]
        for folder in [os.getcwd(), *LOOK_IN]:
            for found in (os.path.join(folder, top + ".py"), os.path.join(folder, top)):
                if os.path.exists(found):
                    return (f"remote_tpu: {top!r} is on this machine ({found}) but not on the "
                            f"hosts: send its directory with working_dir={folder!r} "
                            "(`remote-tpu run --working-dir DIR`), or import it in the calling "
                            "code so that it travels with the function")
    if isinstance(exc, FileNotFoundError) and isinstance(exc.filename, str) and \
            os.path.exists(exc.filename):
        return (f"remote_tpu: {exc.filename!r} exists on this machine but not on the hosts: "
                "send it with working_dir= (the project directory it is in), or as "
                f"remote_tpu.Data({exc.filename!r}) for data")
    return ""


def result_request(job_id: str, data_port: bool = False) -> pb.JobRef:
    """What a client asks Result for: a small value inside the final report
    (what ``outcome`` reads), a large one over the data port if ``data_port``."""
    return pb.JobRef(job_id=job_id, data_port=data_port, value_in_end=True)


# Its pages made at once (MAP_POPULATE, Linux): 1 GiB received in 0.67 s of
# kernel time instead of 1.0-1.1 s, page by page as bytes arrive.
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class _Value:
    """Process 0's pickled value, put together as its chunks arrive: in one
    buffer of the size the gateway announces first (a large one mapped private
    and anonymous, so its pages are made once, as chunks fill them: no zeroing
    ahead, no second copy; measured 1.7x faster to fill than a bytearray), its
    digest computed on the way."""

    MAPPED = 1 << 20

    def __init__(self) -> None:
        self.digest = digests.new()
        self._buffer: bytearray | mmap.mmap | None = None
        self._chunks: list[bytes] = []        # from a gateway that announces no size
        self._size = self._pos = 0

    def sized(self, size: int, job_id: str = "") -> None:
        self._size, self._pos = size, 0
        try:
            self._buffer = (mmap.mmap(-1, size, flags=_MAP_FLAGS)
                            if size >= self.MAPPED else bytearray(size))
        except (OSError, MemoryError, OverflowError) as exc:
            raise SerializationError(
                f"the return value of job {job_id} ({size:,} bytes) does not fit in this "
                f"process's memory ({exc}); it stays in the job's store: free memory, then "
                f"collect it with remote_tpu.attach({job_id!r}, hosts=...).result()") from None

    def add(self, chunk: bytes, job_id: str) -> None:
        self.digest.update(chunk)
        if self._buffer is None:
            self._chunks.append(chunk)
            return
        end = self._pos + len(chunk)
        if end > self._size:
            raise SerializationError(f"the return value of job {job_id} arrived longer than "
                                     f"the {self._size:,} bytes announced; nothing was "
                                     "unpickled. Call again.")
        self._buffer[self._pos:end] = chunk
        self._pos = end

    def fetch(self, gateway: str, ticket: pb.DataTicket, job_id: str) -> bool:
        """The value's bytes over the gateway's data port (``ticket``), into
        its buffer; False (nothing taken) where that port cannot be reached,
        or the transfer broke: it is then asked for again over gRPC."""
        if self._buffer is None:
            return False
        try:
            sock = data_wire.connect(gateway, ticket.port, ticket.nonce)
        except data_wire.Unreachable:
            return False
        view = memoryview(self._buffer)
        try:
            with sock:
                sock.sendall(ticket.ticket)
                self._pos += data_wire.fill(sock, view[self._pos:self._size])
                trouble = data_wire.read_reply(sock) if self._pos == self._size else b""
        except OSError:
            self._pos = 0
            return False
        if self._pos != self._size:
            self._pos = 0
            return False
        if trouble:
            raise SerializationError(f"the return value of job {job_id}: "
                                     f"{trouble.decode(errors='replace')}")
        self.digest.update(view)
        return True

    def data(self, job_id: str) -> bytes | memoryview:
        if self._buffer is None:
            data, self._chunks = b"".join(self._chunks), []
            return data
        if self._pos != self._size:
            raise SerializationError(f"the return value of job {job_id} arrived cut short "
                                     f"({self._pos:,} of {self._size:,} bytes); nothing was "
                                     "unpickled. Call again.")
        return memoryview(self._buffer)


def outcome(stream, renderer: OutputRenderer, *, gateway: str, job_id: str,
            accelerator: str, status: LiveStatus | None = None,
            refetch: Callable[[], Any] | None = None) -> Any:
    """Consume a Run or Result stream: show output, then return the value or
    raise what the caller should see. ``refetch()``: a Result stream without
    the data port, for a value whose ticket could not be used."""
    value = _Value()
    end: pb.JobEnd | None = None
    missed = False        # a ticket for the value that could not be used
    try:
        for event in stream:
            kind = event.WhichOneof("kind")
            if kind == "output":
                if status is not None:
                    status.close()           # the function speaks: the status is gone
                renderer.write(event.host, event.output.stream, event.output.data)
            elif kind == "workers_started" and status is not None:
                status.started(event.workers_started)
            elif kind == "metrics" and status is not None:
                status.stepping(event.metrics.hosts)
            elif kind == "stall":
                if status is not None:
                    status.close()
                sys.stdout.flush()
                print(f"remote_tpu: {event.stall.text}", file=sys.stderr, flush=True)
            elif kind == "result_size":
                value.sized(event.result_size, job_id)
            elif kind == "result_chunk":
                value.add(event.result_chunk, job_id)
            elif kind == "result_ticket":
                missed = not value.fetch(gateway, event.result_ticket, job_id)
            elif kind == "end":
                end = event.end
                if end.value:                 # a small value inside the report
                    value.sized(len(end.value), job_id)
                    value.add(end.value, job_id)
                    end.ClearField("value")
            elif kind == "queued":
                q = event.queued
                ahead = (f"the warm workers of {q.queued_behind} (another caller's "
                         "keep_warm; they end when its process exits, once idle for its "
                         "keep_warm time (a process killed outright cannot end them "
                         f"sooner), or by `remote-tpu release --hosts {gateway}`)"
                         if q.queued_behind.startswith("warm-") else f"job {q.queued_behind}")
                print(f"remote_tpu: job {job_id} is queued behind {ahead} "
                      f"(position {q.queue_position}) on {accelerator}", file=sys.stderr,
                      flush=True)
                if status is not None:
                    status.phase(f"remote_tpu: queued behind {q.queued_behind}")
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, gateway) from None
    except BaseException:
        stream.cancel()          # Ctrl-C: the gateway stops every host
        raise
    finally:
        if status is not None:
            status.close()
        renderer.close()
    if end is None:
        raise AgentUnavailableError(f"the agent at {gateway} ended job {job_id} without a "
                                    "final report; see its log")
    for notice in end.notices:
        print(f"remote_tpu: {notice}", file=sys.stderr, flush=True)
    try:
        raise_for_end(end, accelerator=accelerator, job_id=job_id, label=renderer.label)
    except BaseException as exc:
        try:
            exc.remote_tpu_end = end            # how it ended, for retries= (_retries)
            exc.remote_tpu_job = job_id
        except (AttributeError, TypeError):
            pass
        raise
    if missed and refetch is not None:
        return outcome(refetch(), OutputRenderer("none", renderer.label), gateway=gateway,
                       job_id=job_id, accelerator=accelerator)
    data = value.data(job_id)
    if value.digest.digest() != end.result_digest:
        raise SerializationError(f"the return value of job {job_id} arrived corrupted (its "
                                 f"{digests.NAME} digest does not match the gateway's); nothing was "
                                 "unpickled. Call again.")
    return value_of(data, job_id)


def value_of(data: bytes | memoryview, job_id: str) -> Any:
    """The job's value from its bytes: one pickled value, or (all_results=)
    every process's, a list in process order."""
    try:
        parts = value_list.split(data)
    except ValueError as exc:
        raise SerializationError(f"the return values of job {job_id}: {exc}; nothing was "
                                 "unpickled. Call again.") from None
    if parts is None:
        return loads(data, what="return value")
    return [loads(part, what=f"return value of process {i}") for i, part in enumerate(parts)]
