"""The agent's durable job store: one sqlite table of job records, and per job a
directory with its payload, every host's output log and process 0's outcome.

Records and logs survive an agent restart; a job that was queued or running when
its agent died is marked LOST on the next start, its logs kept. The newest
``keep`` finished jobs are kept; older ones are deleted with their files.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import struct
import threading
import time

from remote_tpu._proto import remote_tpu_pb2 as pb

log = logging.getLogger(__name__)

FINISHED = frozenset({pb.JOB_PHASE_SUCCEEDED, pb.JOB_PHASE_FAILED, pb.JOB_PHASE_CANCELLED,
                      pb.JOB_PHASE_TIMED_OUT, pb.JOB_PHASE_LOST, pb.JOB_PHASE_PREEMPTED})
PHASE_OF_END = {
    pb.JOB_STATE_SUCCEEDED: pb.JOB_PHASE_SUCCEEDED,
    pb.JOB_STATE_FAILED: pb.JOB_PHASE_FAILED,
    pb.JOB_STATE_CANCELLED: pb.JOB_PHASE_CANCELLED,
    pb.JOB_STATE_TIMED_OUT: pb.JOB_PHASE_TIMED_OUT,
    pb.JOB_STATE_LOST: pb.JOB_PHASE_LOST,
    pb.JOB_STATE_PREEMPTED: pb.JOB_PHASE_PREEMPTED,
}
_FRAME = struct.Struct("<BI")    # output stream, length


class HostLog:
    """One host's output of one job: an append-only file of framed records."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None

    def append(self, stream: int, data: bytes) -> None:
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "ab")
            self._file.write(_FRAME.pack(stream, len(data)) + data)
            self._file.flush()          # in the OS: survives the agent, not the machine

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def read(self, offset: int, limit: int = 1 << 20) -> list[tuple[int, bytes, int]]:
        """Whole records from ``offset``: (stream, data, offset after it)."""
        out = []
        try:
            with open(self.path, "rb") as f:
                if offset >= os.fstat(f.fileno()).st_size:
                    return out
                f.seek(offset)
                blob = f.read(limit)
        except FileNotFoundError:
            return out
        pos = 0
        while pos + _FRAME.size <= len(blob):
            stream, length = _FRAME.unpack_from(blob, pos)
            end = pos + _FRAME.size + length
            if end > len(blob):
                if not out and length > limit:    # one record larger than a read
                    return self.read(offset, length + _FRAME.size)
                break
            out.append((stream, blob[pos + _FRAME.size:end], offset + end))
            pos = end
        return out


class JobRecord:
    """A job as this agent knows it. ``changed`` is notified on every new output
    and state change, for watchers."""

    def __init__(self, store: JobStore, spec: pb.JobSpec, role: int, directory: str,
                 status: pb.JobStatus) -> None:
        self.store = store
        self.spec = spec
        self.role = role
        self.dir = directory
        self.status = status
        self.changed = threading.Condition()
        self.version = 0                 # bumped on every change, under `changed`
        self._logs: dict[int, HostLog] = {}

    def touch(self) -> None:
        """Tell watchers something changed (call with ``changed`` held)."""
        self.version += 1
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
                self._logs[host] = HostLog(os.path.join(self.dir, f"host-{host}.log"))
            return self._logs[host]

    def append_output(self, host: int, stream: int, data: bytes) -> None:
        self.log(host).append(stream, data)
        with self.changed:
            self.touch()

    def set_phase(self, phase: int, detail: str = "", end: pb.JobEnd | None = None) -> None:
        with self.changed:
            now = time.time()
            self.status.phase = phase
            if detail:
                self.status.detail = detail
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
                for host_log in self._logs.values():
                    host_log.close()
            self.touch()
        self.store.save(self)
        if phase in FINISHED:
            self.store.prune()


class JobStore:
    def __init__(self, state_dir: str, keep: int = 100) -> None:
        self.state_dir = state_dir
        self.keep = keep
        os.makedirs(os.path.join(state_dir, "jobs"), mode=0o700, exist_ok=True)
        self._db = sqlite3.connect(os.path.join(state_dir, "jobs.sqlite"),
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT, "
                         "role INTEGER, phase INTEGER, created_at REAL, spec BLOB, "
                         "status BLOB, PRIMARY KEY (job_id, role))")
        self._lock = threading.Lock()        # create() is check-then-insert
        self._db_lock = threading.Lock()     # one statement at a time on the connection
        self._live: dict[str, JobRecord] = {}
        self._mark_lost()

    def _sql(self, statement: str, args: tuple = ()) -> list[tuple]:
        with self._db_lock:
            return self._db.execute(statement, args).fetchall()

    def _mark_lost(self) -> None:
        rows = self._sql("SELECT job_id, role, spec, status FROM jobs WHERE phase IN (?, ?)",
                         (pb.JOB_PHASE_QUEUED, pb.JOB_PHASE_RUNNING))
        for job_id, role, spec, status in rows:
            record = self._record(job_id, role, spec, status)
            was = pb.JobPhase.Name(record.status.phase).removeprefix("JOB_PHASE_").lower()
            log.warning("job %s was %s when this agent stopped: marked lost", job_id, was)
            record.status.phase = pb.JOB_PHASE_LOST
            record.status.ended_at = time.time()
            record.status.detail = (f"its agent stopped or restarted while the job was {was}; "
                                    "the logs up to then are kept")
            record.status.end.CopyFrom(pb.JobEnd(state=pb.JOB_STATE_LOST, root_cause_host=-1,
                                                 detail=record.status.detail))
            self.save(record)

    def _dir(self, job_id: str, role: int) -> str:
        suffix = "gateway" if role == pb.ROLE_GATEWAY else "peer"
        return os.path.join(self.state_dir, "jobs", f"{job_id}.{suffix}")

    def _record(self, job_id, role, spec_blob, status_blob) -> JobRecord:
        return JobRecord(self, pb.JobSpec.FromString(spec_blob), role, self._dir(job_id, role),
                         pb.JobStatus.FromString(status_blob))

    def create(self, spec: pb.JobSpec, role: int) -> tuple[JobRecord, bool]:
        """A new QUEUED record, or the existing one (created = False)."""
        with self._lock:
            existing = self.get(spec.job_id, role)
            if existing is not None:
                return existing, False
            status = pb.JobStatus(job_id=spec.job_id, phase=pb.JOB_PHASE_QUEUED,
                                  accelerator=spec.accelerator, num_hosts=spec.num_hosts,
                                  created_at=time.time())
            record = JobRecord(self, spec, role, self._dir(spec.job_id, role), status)
            os.makedirs(record.dir, mode=0o700, exist_ok=True)
            self._live[self._key(spec.job_id, role)] = record
            self.save(record)
            return record, True

    @staticmethod
    def _key(job_id: str, role: int) -> str:
        return f"{job_id}/{role}"

    def get(self, job_id: str, role: int = pb.ROLE_GATEWAY) -> JobRecord | None:
        record = self._live.get(self._key(job_id, role))
        if record is not None:
            return record
        rows = self._sql("SELECT job_id, role, spec, status FROM jobs WHERE job_id = ? "
                         "AND role = ?", (job_id, role))
        return self._record(*rows[0]) if rows else None

    def save(self, record: JobRecord) -> None:
        with record.changed:
            status = record.status.SerializeToString()
            phase = record.status.phase
        self._sql("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
                  (record.job_id, record.role, phase, record.status.created_at,
                   record.spec.SerializeToString(), status))
        if phase in FINISHED:
            self._live.pop(self._key(record.job_id, record.role), None)

    def list(self, role: int = pb.ROLE_GATEWAY, limit: int = 0) -> list[pb.JobStatus]:
        rows = self._sql("SELECT job_id, role, spec, status FROM jobs WHERE role = ? "
                         "ORDER BY created_at DESC" + (" LIMIT ?" if limit else ""),
                         (role, limit) if limit else (role,))
        out = []
        for row in rows:
            live = self._live.get(self._key(row[0], row[1]))
            out.append(live.status if live is not None else pb.JobStatus.FromString(row[3]))
        return out

    def prune(self) -> None:
        """Delete the oldest finished jobs beyond ``keep``, with their files."""
        rows = self._sql(
            "SELECT job_id, role FROM jobs WHERE phase NOT IN (?, ?) ORDER BY created_at DESC "
            "LIMIT -1 OFFSET ?", (pb.JOB_PHASE_QUEUED, pb.JOB_PHASE_RUNNING, self.keep))
        for job_id, role in rows:
            self._sql("DELETE FROM jobs WHERE job_id = ? AND role = ?", (job_id, role))
            shutil.rmtree(self._dir(job_id, role), ignore_errors=True)

    def close(self) -> None:
        with self._db_lock:
            self._db.close()
