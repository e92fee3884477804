"""The agent's durable job store: one sqlite table of job records (a small
value kept in its row), and per job a directory, made when something first goes
there: a large payload, every host's output log, a large value.

Records and logs survive an agent restart; a job that was queued or running when
its agent died is marked LOST on the next start, its logs kept. The ``keep``
jobs that finished last are kept; older ones are deleted with their files.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import re
import shutil
import sqlite3
import stat
import threading
import time

from remote_tpu._core.dirs import make_private
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.states import FINISHED, phase_name

from remote_tpu_agent.jobs.host_log import DEFAULT_MAX_LOG_BYTES
from remote_tpu_agent.jobs.record import JobRecord  # noqa: F401 - where the store's users find it
from remote_tpu_agent.worker.child import PAYLOAD_FILE

log = logging.getLogger(__name__)

DEFAULT_MAX_STORE_BYTES = 32 << 30


def _check_own(state_dir: str) -> None:
    """The state directory is the agent's own: made 0700, so never a shared one."""
    try:
        st = os.stat(state_dir)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
        raise ConfigurationError(
            f"--state-dir {state_dir} is not this agent's own directory (it is shared, "
            "or owned by another user) and would be made private to this user: give the "
            "agent a directory of its own, e.g. ~/.local/state/remote_tpu/agent-PORT")


class JobStore:
    """The records of one agent's jobs, owner-only (directories 0700, files
    0600): they hold job specs, ``env=`` values among them.

    Why over 200 lines: its index (SQLite), the records' files and the
    bounds (jobs kept, bytes kept, each measured as it is written) are one
    consistency domain; the per-job parts already live in ``jobs.record`` and
    ``jobs.host_log``.
    """

    def __init__(self, state_dir: str, keep: int = 100,
                 max_log_bytes: int = DEFAULT_MAX_LOG_BYTES,
                 max_store_bytes: int = DEFAULT_MAX_STORE_BYTES) -> None:
        self.state_dir = state_dir
        self.keep = keep
        self.max_log_bytes = max_log_bytes
        self.max_store_bytes = max_store_bytes
        _check_own(state_dir)
        for directory in (state_dir, os.path.join(state_dir, "jobs")):
            make_private(directory)      # (and those above it that it makes)
            os.chmod(directory, 0o700)   # the agent's own: _check_own
        db_path = os.path.join(state_dir, "jobs.sqlite")
        # SQLite gives its -wal and -shm files the mode of the database file.
        os.close(os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600))
        for path in (db_path, db_path + "-wal", db_path + "-shm"):
            if os.path.exists(path):
                os.chmod(path, 0o600)
        self._db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT, "
                         "role INTEGER, phase INTEGER, created_at REAL, spec BLOB, "
                         "status BLOB, ended_at REAL DEFAULT 0, "
                         "PRIMARY KEY (job_id, role))")
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(jobs)")]
        # Columns a store written by an earlier agent lacks: when a job ended.
        # A small value (inline) is kept with its record, not in a file of its own.
        # (An earlier agent's column of sizes, bytes, is no longer read: what a
        # finished job's files take is measured once after each start.)
        for column, kind in (("ended_at", "REAL DEFAULT 0"), ("result", "BLOB")):
            if column not in columns:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        self._lock = threading.Lock()        # create() is check-then-insert
        self._db_lock = threading.Lock()     # one statement at a time on the connection
        self._prune_lock = threading.Lock()
        self._done_lock = threading.Lock()   # (create() saves under _lock)
        self._save_lock = threading.RLock()
        self._live: dict[str, JobRecord] = {}
        self._unsaved: dict[str, JobRecord] = {}   # saves that failed (disk full)
        self._moving: dict[str, JobRecord] = {}    # finished, their value on its way in
        # Finished jobs, oldest first: key -> [job_id, role, bytes (None: to be
        # measured), its small value's bytes], what they take all together, and
        # those still to be measured. Pruning reads these, not the table (a
        # query over every finished job cost 0.3-0.6 ms per job here), and
        # drops the oldest: no pass over every job either.
        self._done: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._done_bytes = 0
        # Those to measure, each with when it was last found so: a measure
        # taken before then (its value arrived meanwhile) is not applied.
        self._unmeasured: dict[str, int] = {}
        self._marks = itertools.count()
        self._mark_lost()
        self._done.clear()                  # (read in the order the jobs ended)
        self._done_bytes = 0
        self._unmeasured.clear()
        for job_id, role, kept in self._sql(
                "SELECT job_id, role, IFNULL(length(result), 0) FROM jobs "
                "WHERE phase NOT IN (?, ?) ORDER BY CASE WHEN ended_at > 0 THEN "
                "ended_at ELSE created_at END", (pb.JOB_PHASE_QUEUED, pb.JOB_PHASE_RUNNING)):
            self._done_entry(self._key(job_id, role), job_id, role)[3] = kept
            self._done_bytes += kept

    def full_message(self) -> str:
        return (f"the agent's state dir {self.state_dir} is full: free space there, or "
                "start the agent with a smaller --keep-jobs, --max-log-bytes or "
                "--max-store-bytes")

    def _sql(self, statement: str, args: tuple = ()) -> list[tuple]:
        with self._db_lock:
            return self._db.execute(statement, args).fetchall()

    def _mark_lost(self) -> None:
        rows = self._sql("SELECT job_id, role, spec, status FROM jobs WHERE phase IN (?, ?)",
                         (pb.JOB_PHASE_QUEUED, pb.JOB_PHASE_RUNNING))
        for job_id, role, spec, status in rows:
            record = self._record(job_id, role, spec, status)
            was = phase_name(record.status.phase).lower()
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

    def create(self, spec: pb.JobSpec, role: int, save: bool = True
               ) -> tuple[JobRecord, bool]:
        """A new QUEUED record, or the existing one (created = False). Not
        ``save``d: known here at once (``get``), written by its next save."""
        with self._lock:
            existing = self.get(spec.job_id, role)
            if existing is not None:
                return existing, False
            status = pb.JobStatus(job_id=spec.job_id, phase=pb.JOB_PHASE_QUEUED,
                                  accelerator=spec.accelerator, num_hosts=spec.num_hosts,
                                  created_at=time.time(), num_slices=spec.num_slices)
            record = JobRecord(self, spec, role, self._dir(spec.job_id, role), status)
            self._live[self._key(spec.job_id, role)] = record
            if save:
                self.save(record)
            return record, True

    @staticmethod
    def _key(job_id: str, role: int) -> str:
        return f"{job_id}/{role}"

    def get(self, job_id: str, role: int = pb.ROLE_GATEWAY) -> JobRecord | None:
        key = self._key(job_id, role)
        record = self._live.get(key) or self._unsaved.get(key) or self._moving.get(key)
        if record is not None:
            return record
        # Every job in the table is live, unsaved, moving or finished
        # (``_done``): an id it does not hold costs no query.
        with self._done_lock:
            if key not in self._done:
                return None
        rows = self._sql("SELECT job_id, role, spec, status FROM jobs WHERE job_id = ? "
                         "AND role = ?", (job_id, role))
        return self._record(*rows[0]) if rows else None

    def save(self, record: JobRecord) -> None:
        """Write the record. When the disk is full it stays in memory (and is
        answered from there) until a later save can write it."""
        with self._save_lock:
            for item in [*self._unsaved.values(), record]:
                self._save_one(item)

    def _save_one(self, record: JobRecord) -> None:
        key = self._key(record.job_id, record.role)
        with record.changed:
            status = record.status.SerializeToString()
            phase = record.status.phase
        try:
            # (a record read back from the table carries no value: the stored one stays)
            self._sql("INSERT INTO jobs (job_id, role, phase, created_at, spec, status, "
                      "ended_at, result) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                      "ON CONFLICT (job_id, role) DO UPDATE SET phase = excluded.phase, "
                      "spec = excluded.spec, status = excluded.status, "
                      "ended_at = excluded.ended_at, "
                      "result = COALESCE(excluded.result, result)",
                      (record.job_id, record.role, phase, record.status.created_at,
                       record.spec.SerializeToString(), status, record.status.ended_at,
                       record.result if phase in FINISHED else None))
        except (sqlite3.Error, OSError) as exc:
            if key not in self._unsaved:
                log.error("job %s: cannot save its record (%s); it is kept in memory until "
                          "it can be: %s", record.job_id, exc, self.full_message())
            self._unsaved[key] = record
            return
        self._unsaved.pop(key, None)
        if phase in FINISHED:
            with self._done_lock:
                entry = self._done_entry(key, record.job_id, record.role)
                self._measured(key, None)        # (its files may have changed)
                if record.result is not None:
                    self._done_bytes += len(record.result) - entry[3]
                    entry[3] = len(record.result)
            self._live.pop(key, None)            # (after: ``create`` looks in both)

    def _done_entry(self, key: str, job_id: str, role: int) -> list:
        """(With ``_done_lock`` held, or alone.) A finished job's entry, made
        (unmeasured, newest) if it has none."""
        entry = self._done.get(key)
        if entry is None:
            entry = self._done[key] = [job_id, role, None, 0]
            self._unmeasured[key] = next(self._marks)
        return entry

    def _measured(self, key: str, size: int | None) -> None:
        """(With ``_done_lock`` held, or alone.) A finished job's files take
        ``size`` bytes (None: not known, to be measured by the next prune)."""
        entry = self._done[key]
        self._done_bytes += (size or 0) - (entry[2] or 0)
        entry[2] = size
        if size is None:
            self._unmeasured[key] = next(self._marks)
        else:
            self._unmeasured.pop(key, None)

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
        """Delete the jobs that finished longest ago beyond ``keep``, and beyond
        ``max_store_bytes`` all together (the job that finished last stays, so a
        caller can always collect the result of the job that just ended)."""
        with self._prune_lock:
            with self._done_lock:
                todo = [(key, mark, *self._done[key][:2])
                        for key, mark in self._unmeasured.items()]
            for key, mark, job_id, role in todo:   # once: a finished job's files stay so
                size = _tree_size(self._dir(job_id, role)) + \
                    _tree_size(self._outputs_dir(job_id))
                with self._done_lock:
                    if self._unmeasured.get(key) == mark:   # (else: to measure again)
                        self._measured(key, size)
            # The oldest go, beyond ``keep`` or while all together take more
            # than ``max_store_bytes`` (never the newest).
            while True:
                with self._done_lock:
                    n = len(self._done)
                    if not (n > self.keep or (n > 1 and self._done_bytes > self.max_store_bytes)):
                        return
                    job_id, role = next(iter(self._done.values()))[:2]
                if not self._delete(job_id, role):
                    return

    def saved_result(self, record: JobRecord) -> bytes | None:
        rows = self._sql("SELECT result FROM jobs WHERE job_id = ? AND role = ?",
                         (record.job_id, record.role))
        return rows[0][0] if rows and rows[0][0] is not None else None

    def moving(self, record: JobRecord, on: bool) -> None:
        """While a finished job's value moves to its directory, ``get`` answers
        with the record that knows where it is meanwhile."""
        key = self._key(record.job_id, record.role)
        with self._lock:
            if on:
                self._moving[key] = record
            else:
                self._moving.pop(key, None)

    def measure_again(self, record: JobRecord) -> None:
        """A finished job's files changed (its value arrived): count them anew."""
        key = self._key(record.job_id, record.role)
        with self._done_lock:
            if key in self._done:
                self._measured(key, None)
        self.prune()

    def _delete(self, job_id: str, role: int) -> bool:
        try:
            self._sql("DELETE FROM jobs WHERE job_id = ? AND role = ?", (job_id, role))
        except sqlite3.Error as exc:
            log.warning("job %s: cannot delete its record: %s", job_id, exc)
            return False
        key = self._key(job_id, role)
        with self._done_lock:
            entry = self._done.pop(key, None)
            self._unmeasured.pop(key, None)
            if entry is not None:
                self._done_bytes -= (entry[2] or 0) + entry[3]
        for directory in (self._dir(job_id, role), self._outputs_dir(job_id)):
            if os.path.lexists(directory):
                shutil.rmtree(directory, ignore_errors=True)
        return True

    def _outputs_dir(self, job_id: str) -> str:
        """A job's output_dir= files on this host (a peer's record is JOB.pN)."""
        return os.path.join(self.state_dir, "outputs", re.sub(r"\.p\d+$", "", job_id))

    def close(self) -> None:
        with self._db_lock:
            self._db.close()


def _tree_size(path: str) -> int:
    """What a finished job's files take (its payload, deleted as it ends, aside)."""
    total = 0
    if not os.path.isdir(path):       # (most finished calls leave none: one stat, no walk)
        return 0
    for directory, _, files in os.walk(path):
        for name in files:
            if name == PAYLOAD_FILE:
                continue
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:
                pass
    return total
