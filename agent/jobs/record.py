"""One job as its agent knows it: spec, status, output logs, and process 0's
value on its way to the store (kept by ``JobStore``, in ``jobs.store``)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from remote_tpu._core.limits import DETAIL_CHARS, cut_text
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import FINISHED

from remote_tpu_agent.jobs.host_log import HostLog, StoreFull
from remote_tpu_agent.worker.child import RESULT_FILE, private

log = logging.getLogger(__name__)

_ATTACHED_READ_WAIT = 3600.0     # at most, for an attached caller to read a large value


class JobRecord:
    """A job as this agent knows it. ``changed`` is notified on every new output
    and state change, for watchers."""

    def __init__(self, store: Any, spec: pb.JobSpec, role: int, directory: str,
                 status: pb.JobStatus) -> None:
        self.store = store
        self.spec = spec
        self.role = role
        self.dir = directory
        self.status = status
        self.changed = threading.Condition()
        self.version = 0                 # bumped on every change, under `changed`
        # While queued and running (gateway): the payload, inline, or its file's path.
        self.payload: bytes | str = b""
        # ... and its large buffers' files in the argument cache (pinned there until
        # ``unpin`` is called, when the job is over).
        self.blob_paths: list[str] = []
        self.unpin: Callable[[], None] | None = None
        # Process 0's pickled value, once it succeeded, until written to its file.
        self.result: bytes | None = None
        self.result_path = ""           # a large value's file while on its way to self.dir
        # An attached caller's stream: a large value moves to self.dir once it has
        # been read from where it landed (in memory), not while it is read.
        self.attached = False
        self.followers = 0               # attached callers following it now (gateway.role)
        self.result_read = threading.Event()
        self.result_ticketed = False    # its caller fetches it over the data port (jobs.views)
        # retries=: seconds until its next attempt, between two (``jobs.attempts``).
        self.retry_in: float | None = None
        self.workers_started = 0        # this attempt's processes started (for followers)
        self._logs: dict[int, HostLog] = {}

    def touch(self, wake: bool = True) -> None:
        """Tell watchers something changed (call with ``changed`` held).
        Watchers (``jobs.views.watch``) follow output, workers started and
        the end; a change of status only (a place in the queue, running, an
        attempt) counts without waking them (``wake=False``): a watcher that
        looks anyway sees it."""
        self.version += 1
        if wake:
            self.changed.notify_all()

    @property
    def job_id(self) -> str:
        return self.status.job_id

    @property
    def finished(self) -> bool:
        return self.status.phase in FINISHED

    def log(self, host: int) -> HostLog:
        with self.changed:
            if host not in self._logs:
                self._logs[host] = HostLog(os.path.join(self.dir, f"host-{host}.log"),
                                           self.store.max_log_bytes, host)
            return self._logs[host]

    def append_output(self, host: int, stream: int, data: bytes) -> None:
        """Store one host's output. Raises :class:`StoreFull` the first time the
        disk is full; from then on counts what could not be stored."""
        host_log = self.log(host)
        try:
            if host_log.dropped:
                host_log.dropped += len(data)
                return
            try:
                host_log.append(stream, data)
            except StoreFull:
                host_log.dropped += len(data)
                raise StoreFull(errno.ENOSPC, self.store.full_message()) from None
        finally:
            with self.changed:
                self.touch()

    def add_stall(self, stall: pb.StallReport, kept: int) -> None:
        """A stall report (``gateway.stalls``): kept with the job (at most
        ``kept``: the first half and the newest), saved, its followers woken
        (they send what is newer than what they sent: ``jobs.views``)."""
        with self.changed:
            if len(self.status.stalls) >= kept:
                del self.status.stalls[kept // 2]
            self.status.stalls.append(stall)
            self.touch()
        self.store.save(self)

    def worker_started(self) -> None:
        with self.changed:
            self.workers_started += 1
            self.touch()

    def say(self, host: int, line: str) -> bytes:
        """A line of this host's stderr from the agent itself (an installer's
        output, an upload that failed), stored like the worker's (a full store
        only counts it); its bytes."""
        data = f"{line}\n".encode()
        try:
            self.append_output(host, pb.OUTPUT_STREAM_STDERR, data)
        except StoreFull:
            pass
        return data

    def dropped_output(self) -> int:
        """Bytes of output that could not be stored (the disk was full)."""
        with self.changed:
            return sum(host_log.dropped for host_log in self._logs.values())

    def make_dir(self) -> str:
        """The job's directory, made on first need (a call that prints nothing
        and returns a small value has none: its record is all it leaves)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        return self.dir

    def keep_result(self, data: bytes | None, path: str = "") -> None:
        """Process 0's value: when it came inline, kept in memory and stored
        with the job's record (by the save that finishes it); when it came in
        a file elsewhere (in memory), moved to the job's directory in the
        background, readers reading it where it is meanwhile
        (``result_path``)."""
        if data is not None:
            self.result = data
            return
        own = os.path.join(self.dir, RESULT_FILE)
        if path and os.path.realpath(path) != os.path.realpath(own):
            self.result_path = path
            self.store.moving(self, True)     # later readers find this record
            threading.Thread(target=self._move_result, args=(path, own), daemon=True,
                             name=f"result-{self.job_id}").start()

    def result_sent(self) -> None:
        """The attached caller's stream is over (its value read, or not wanted)."""
        self.result_read.set()

    def stored_result(self) -> bytes | None:
        """A small value: in memory, or in the job's saved record (None: its
        value is in a file, or it has none)."""
        return self.result if self.result is not None else self.store.saved_result(self)

    def _move_result(self, path: str, own: str) -> None:
        if self.attached:     # not while its caller reads it: the copy would slow that down
            self.result_read.wait(_ATTACHED_READ_WAIT)
        try:
            self.make_dir()
            try:
                os.replace(path, own)                 # the same file system: at once
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                tmp = own + ".moving"
                os.close(private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
                shutil.copyfile(path, tmp)            # in the kernel (sendfile)
                os.replace(tmp, own)
        except OSError as exc:
            log.error("job %s: cannot store its result in %s (%s); only its attached "
                      "caller gets it", self.job_id, own, exc)
        finally:
            self.result_path = ""
            self.store.moving(self, False)
            try:
                os.unlink(path)
            except OSError:
                pass
        self.store.measure_again(self)      # its size, measured as it ended, lacked it
    def set_phase(self, phase: int, detail: str = "", end: pb.JobEnd | None = None) -> None:
        with self.changed:
            now = time.time()
            self.status.phase = phase
            if detail:
                self.status.detail = cut_text(detail, DETAIL_CHARS)
            if phase == pb.JOB_PHASE_RUNNING:
                self.status.started_at = now
                self.status.queued_behind = ""
                self.status.queue_position = 0
            if phase in FINISHED:
                self.status.ended_at = now
                self.status.queued_behind = ""
                self.status.queue_position = 0
                if end is not None:
                    self.status.end.CopyFrom(end)
                    self.status.end.num_slices = self.spec.num_slices
                for host_log in self._logs.values():
                    host_log.close()
            self.touch(wake=phase in FINISHED)
        self.store.save(self)
        if phase in FINISHED:
            self.store.prune()
