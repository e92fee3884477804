"""Reading the gateway's jobs: status, output (to its end, or followed), the
result, the list. Everything comes from the job store; nothing here runs jobs."""

from __future__ import annotations

import heapq
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core.limits import CHUNK_SIZE, LIST_REPLY_BYTES, cut_text
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.wire.data_port import TICKET_SECONDS, DataPort
from remote_tpu_agent.wire.discovery import Slice
from remote_tpu_agent.jobs.host_log import TIME_MARK, time_of
from remote_tpu_agent.jobs.requests import abort, gateway_redirect, valid_job_id
from remote_tpu_agent.jobs.store import JobRecord, JobStore

log = logging.getLogger(__name__)


def status_of(record: JobRecord) -> pb.JobStatus:
    """A copy of the record's status, taken under its lock."""
    with record.changed:
        status = pb.JobStatus()
        status.CopyFrom(record.status)
    return status


class JobViews:
    def __init__(self, store: JobStore, found: Slice, endpoint: Callable[[], str]) -> None:
        self.store = store
        self._slice = found
        self._endpoint = endpoint

    def known(self, job_id: str, context: grpc.ServicerContext) -> JobRecord:
        """The gateway record of ``job_id``, or the call is aborted: NOT_FOUND,
        or, on a host that is not its slice's gateway, a redirect to it."""
        record = self.store.get(job_id) if valid_job_id(job_id) else None
        if record is None:
            redirect = gateway_redirect(self._slice, self._endpoint())
            if redirect is not None:
                abort(context, redirect)
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"the agent at {self._endpoint()} has no job "
                          f"{cut_text(job_id, 200)!r} (finished jobs are kept: the newest "
                          f"{self.store.keep})")
        return record

    def status(self, job_id: str, context: grpc.ServicerContext,
               metrics: Callable[[str], list[pb.HostMetrics]]) -> pb.JobStatus:
        """A job's status; a running one's with its processes' metrics now
        (``metrics``: the gateway's, ``gateway.metrics``)."""
        status = status_of(self.known(job_id, context))
        if status.phase == pb.JOB_PHASE_RUNNING:
            status.metrics.extend(metrics(status.job_id))
        return status

    def list(self, limit: int, context: grpc.ServicerContext) -> pb.ListJobsReply:
        """Summaries (no final reports), newest first, as many as fit one reply.
        A host that is not its slice's gateway always sends the caller to the
        gateway, whose jobs are the slice's (a job that a client ran with this
        host first in its own host list is still found here by its id)."""
        redirect = gateway_redirect(self._slice, self._endpoint())
        if redirect is not None:
            abort(context, redirect)
        reply = pb.ListJobsReply()
        statuses = self.store.list(limit=limit)
        size = 0
        for i, status in enumerate(statuses):
            summary = pb.JobStatus()
            summary.CopyFrom(status)
            summary.ClearField("end")
            summary.ClearField("stalls")
            size += summary.ByteSize() + 8
            if size > LIST_REPLY_BYTES:
                reply.omitted = len(statuses) - i
                break
            reply.jobs.append(summary)
        return reply


def watch(record: JobRecord, hosts: list[int], offsets: list[int], follow: bool,
          context: grpc.ServicerContext, with_end: bool, since: float = 0.0,
          metrics: Callable[[], list[pb.HostMetrics]] | None = None) -> Iterator[pb.Event]:
    """Every host's output from its offset to the end of its log: without
    ``follow`` the end as it is now, with it the job's end (every byte written
    before the job finished is sent before the end); only what was stored
    from ``since`` on, where its time is known. ``metrics`` (an attached
    caller's): the job's metrics, sent about once a second while some process
    reports its steps (for the caller's status line)."""
    sent_metrics = time.monotonic()
    position = {h: (offsets[i] if i < len(offsets) else 0) for i, h in enumerate(hosts)}
    when = dict.fromkeys(hosts, 0.0)    # each host's last time mark read (host_log)
    # Without follow, a running job's logs are read up to where they end now.
    stop = None if follow or record.finished else {h: record.log(h).end() for h in hosts}
    told = 0                      # workers started, as the follower was told
    stalls_sent = 0.0                # the newest stall report sent (its time)
    while context.is_active():
        with record.changed:
            finished = record.finished
            version = record.version
            started = record.workers_started
            new_stalls = [s for s in record.status.stalls if s.at > stalls_sent]
        if follow and started != told and not finished:
            told = started
            yield pb.Event(host=0, workers_started=started)
        for stall in new_stalls if follow else []:
            stalls_sent = stall.at
            yield pb.Event(host=0, stall=stall)
        if metrics is not None and not finished and \
                time.monotonic() - sent_metrics >= METRICS_SECONDS:
            sent_metrics = time.monotonic()
            try:
                now = metrics()
            except Exception:  # noqa: BLE001 - figures for a status line: never the call's end
                log.exception("job %s: its metrics could not be read", record.job_id)
                now = []
            if any(m.has_step for m in now):
                yield pb.Event(host=0, metrics=pb.MetricsNow(hosts=now))
        sent = False
        for h in hosts:
            if stop is not None and position[h] >= stop[h]:
                continue
            for stream, data, offset in record.log(h).read(position[h], marks=True):
                position[h] = offset
                sent = True                # (a mark too: what follows it is read next)
                if stream == TIME_MARK:
                    when[h] = time_of(data)
                    continue
                if when[h] and when[h] < since:
                    continue
                yield pb.Event(host=h, output=pb.Output(stream=stream, data=data,
                                                        offset=offset, time=when[h]))
        if sent:
            continue              # read on until a pass finds nothing new
        if finished:
            if with_end:
                yield pb.Event(host=0, end=status_of(record).end)
            return
        if not follow:
            return
        with record.changed:
            record.changed.wait_for(lambda: record.version != version, timeout=1.0)


METRICS_SECONDS = 1.0       # between two metrics events to an attached caller


def merged(record: JobRecord, hosts: list[int], since: float = 0.0) -> Iterator[pb.Event]:
    """The hosts' logs as they are now, merged in time order (each host's
    own order kept; a log without times comes after the others' output of
    its time 0, host by host), from ``since``; then the job's end if it is over.
    Holds one read of each log at a time."""
    def timed(h: int) -> Iterator[tuple[float, int, int, bytes, int]]:
        log, position, when = record.log(h), 0, 0.0
        stop = log.end()
        while position < stop and (batch := log.read(position, marks=True)):
            for stream, data, offset in batch:
                position = offset
                if stream == TIME_MARK:
                    when = time_of(data)
                elif not when or when >= since:
                    yield when, h, stream, data, offset
    for when, h, stream, data, offset in heapq.merge(*map(timed, hosts), key=lambda r: r[0]):
        yield pb.Event(host=h, output=pb.Output(stream=stream, data=data, offset=offset,
                                                time=when))
    if record.finished:
        yield pb.Event(host=0, end=status_of(record).end)


def result(record: JobRecord, data_port: DataPort | None = None,
           value_in_end: bool = False) -> Iterator[pb.Event]:
    """A finished job's value (when it succeeded): its size, then its chunks,
    or (a large one, to a caller that asked) a ticket to fetch it over
    ``data_port``; then the final report. A small value goes inside that report
    to a caller that asked (``value_in_end``)."""
    if record.status.phase == pb.JOB_PHASE_SUCCEEDED:
        data = record.stored_result()      # small: in memory or its record; else a file
        if data is not None and value_in_end and len(data) <= VALUE_IN_END_BYTES:
            end = pb.JobEnd()
            end.CopyFrom(record.status.end)
            end.value = data
            yield pb.Event(host=0, end=end)
            return
        if data is not None:
            yield pb.Event(host=0, result_size=len(data))
            for start in range(0, len(data), CHUNK_SIZE):
                yield pb.Event(host=0, result_chunk=data[start:start + CHUNK_SIZE])
        else:
            with _open_result(record) as f:
                yield pb.Event(host=0, result_size=os.fstat(f.fileno()).st_size)
            ticket = None if data_port is None else _result_ticket(record, data_port)
            if ticket is not None:
                yield pb.Event(host=0, result_ticket=ticket)
            else:
                yield from _result_chunks(record)
    yield pb.Event(host=0, end=record.status.end)


VALUE_IN_END_BYTES = 64 << 10


def _result_chunks(record: JobRecord) -> Iterator[pb.Event]:
    with _open_result(record) as f:
        while chunk := f.read(CHUNK_SIZE):
            yield pb.Event(host=0, result_chunk=chunk)
    if record.result_ticketed:      # its caller could not use the ticket, and read it here
        record.result_ticketed = False
        record.result_sent()


def _result_ticket(record: JobRecord, data_port: DataPort) -> pb.DataTicket | None:
    """A ticket for a large value's bytes (sent from its file by the kernel);
    the value's move to the job's directory waits for that transfer (or for the
    ticket to lapse)."""
    def send(sock: socket.socket) -> bytes:
        try:
            with _open_result(record) as f:
                sock.sendfile(f)
            return b""
        except OSError as exc:
            return f"the value could not be sent: {exc}".encode()
        finally:
            record.result_ticketed = False
            record.result_sent()

    ticket = data_port.issue(send)
    if ticket is None:
        return None
    record.result_ticketed = True
    lapse = threading.Timer(TICKET_SECONDS + 5, record.result_sent)
    lapse.daemon = True
    lapse.start()
    return pb.DataTicket(port=data_port.port, nonce=data_port.nonce, ticket=ticket)


def _open_result(record: JobRecord):
    """A large value's file: where it landed (in memory) while it is moved to
    the job's directory, else there. (Once open, a move does not disturb it.)"""
    moving = record.result_path
    if moving:
        try:
            return open(moving, "rb")
        except FileNotFoundError:
            pass                       # moved meanwhile
    return open(os.path.join(record.dir, _worker.RESULT_FILE), "rb")
