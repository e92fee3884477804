"""output_dir=: each process's local output directory, saved while it runs.

Every process of a job gets two local directories on its host: its own
(``REMOTE_TPU_OUTPUT_DIR``, saved under ``host_{i}/``, i its process id) and
the job's shared one (``REMOTE_TPU_SHARED_OUTPUT_DIR``, saved at the top).
With a ``gs://bucket/prefix`` destination, files new or changed since the last
pass are uploaded to ``gs://bucket/prefix/{job_id}/...`` every
``--output-interval`` seconds while the job runs, and once more as each
process finishes (failed ones too, before its host reports), so a preempted
host loses at most one interval of output. With a destination on the client
(``output_dir=`` a local directory), the files stay here for the client to
collect (``OutputFiles``), and are removed with the job's other files.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.gcs import failure
from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 30.0
LARGE = 64 << 20                   # uploaded resumably, in chunks of CHUNK
CHUNK = 16 << 20


def job_root(state_dir: str, job_id: str) -> str:
    return os.path.join(state_dir, "outputs", job_id)


def local_dirs(state_dir: str, job_id: str, process_id: int) -> tuple[str, str]:
    """(this process's own directory, the job's shared one) on this host."""
    root = job_root(state_dir, job_id)
    return os.path.join(root, f"host_{process_id}"), os.path.join(root, "shared")


def output_env(spec: pb.JobSpec, state_dir: str, process_id: int) -> dict[str, str]:
    """The worker's variables for ``output_dir=`` (none without it); the
    directories are made here."""
    if not (spec.output_dir or spec.collect_outputs):
        return {}
    own, shared = local_dirs(state_dir, spec.job_id, process_id)
    for d in (own, shared):
        os.makedirs(d, mode=0o700, exist_ok=True)
    return {"REMOTE_TPU_OUTPUT_DIR": own, "REMOTE_TPU_SHARED_OUTPUT_DIR": shared}


def split_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/prefix`` -> (bucket, prefix without slashes at its ends)."""
    rest = uri[len("gs://"):]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


class OutputSync:
    """Uploads one job's outputs on this host (its processes ``process_ids``)
    to ``spec.output_dir``, every ``interval`` seconds and at ``finish``. What
    could not be uploaded is said through ``warn`` (a line on that process's
    stderr, kept in the job's log)."""

    def __init__(self, spec: pb.JobSpec, state_dir: str, process_ids: list[int],
                 warn: Callable[[int, str], None], interval: float = DEFAULT_INTERVAL) -> None:
        self.uri = spec.output_dir
        self._state_dir = state_dir
        self._root = job_root(state_dir, spec.job_id)
        self._job_id = spec.job_id
        self._ids = process_ids
        self._warn = warn
        self._interval = interval
        self._sent: dict[str, tuple[int, int]] = {}     # local path: (size, mtime) uploaded
        self._failed: set[str] = set()                   # said once each
        self._problems: dict[str, str] = {}              # not saved (yet): why
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bucket = None

    def start(self) -> OutputSync:
        if self.uri:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"outputs-{self._job_id}")
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sync()

    def finish(self) -> list[str]:
        """The last pass (the processes have finished writing), then stop; what
        went wrong in it (said only here: the caller is about to be told)."""
        if self._stop.is_set():
            return []
        self._stop.set()
        if not self.uri:
            return []
        self.sync()
        if not self._problems:                  # all saved: this host's copies go
            for i in self._ids:
                shutil.rmtree(local_dirs(self._state_dir, self._job_id, i)[0],
                              ignore_errors=True)
        problems = list(self._problems.values())
        if len(problems) > 3:
            problems[3:] = [f"{len(problems) - 3} more output file(s) of this host could not "
                            f"be uploaded; they stay in {self._root} on it"]
        return problems

    def _files(self) -> list[tuple[str, str, int]]:
        """(local path, object name under the job's prefix, its process or -1)."""
        out = []
        places = [(f"host_{i}", i) for i in self._ids] + [("shared", -1)]
        for name, owner in places:
            top = os.path.join(self._root, name)
            for directory, _, files in os.walk(top):
                for f in files:
                    path = os.path.join(directory, f)
                    rel = os.path.relpath(path, top).replace(os.sep, "/")
                    out.append((path, rel if owner < 0 else f"{name}/{rel}", owner))
        return out

    def sync(self) -> None:
        with self._lock:
            try:
                bucket_name, prefix = split_uri(self.uri)
                for path, rel, owner in self._files():
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue                       # removed meanwhile
                    if self._sent.get(path) == (st.st_size, st.st_mtime_ns):
                        continue
                    name = "/".join(p for p in (prefix, self._job_id, rel) if p)
                    try:
                        self._upload(bucket_name, name, path, st.st_size)
                        self._sent[path] = (st.st_size, st.st_mtime_ns)
                        self._problems.pop(path, None)
                    except Exception as exc:  # noqa: BLE001 - said, and tried again next pass
                        self._problems[path] = self._say(owner, f"gs://{bucket_name}/{name}",
                                                         exc)
                self._problems.pop("", None)
            except Exception as exc:  # noqa: BLE001 - e.g. no credentials on this host
                self._problems[""] = self._say(self._ids[0] if self._ids else 0, self.uri, exc)

    def _upload(self, bucket_name: str, name: str, path: str, size: int) -> None:
        from google.cloud.storage.retry import DEFAULT_RETRY

        if self._bucket is None:
            from google.cloud import storage     # here: an agent without output_dir= never pays
            self._bucket = storage.Client().bucket(bucket_name)
        blob = self._bucket.blob(name, chunk_size=CHUNK if size >= LARGE else None)
        # Writing the same object again is harmless: retry transient errors.
        blob.upload_from_filename(path, retry=DEFAULT_RETRY, timeout=300)

    def _say(self, owner: int, where: str, exc: Exception) -> str:
        """Why an upload failed: said once (on the process's stderr) while the
        job runs; the last pass's problems go to the caller (``finish``)."""
        why = _explain(exc, where)
        key = f"{where}: {type(exc).__name__}"
        if key in self._failed:
            return why
        self._failed.add(key)
        log.warning("job %s: %s", self._job_id, why)
        if not self._stop.is_set():
            try:
                self._warn(max(owner, self._ids[0] if self._ids else 0), f"remote_tpu: {why}")
            except Exception:  # noqa: BLE001 - a full store, say: the log has it
                pass
        return why


def _explain(exc: Exception, where: str) -> str:
    """What went wrong with an upload, and what to do."""
    return f"could not upload output {where}: " + failure(
        exc, where, "storage.objects.create",
        otherwise="it is tried again at the next pass and as the job ends")


def own_files(state_dir: str, job_id: str) -> Iterator[pb.OutputChunk]:
    """This host's output files of a job, in chunks (the first of each file
    carries its size; an empty file is one chunk)."""
    root = job_root(state_dir, job_id)
    for directory, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(files):
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    offset = 0
                    while True:
                        data = f.read(CHUNK_SIZE)
                        yield pb.OutputChunk(path=rel, size=size, offset=offset, data=data)
                        offset += len(data)
                        if len(data) < CHUNK_SIZE:
                            break
            except OSError as exc:
                yield pb.OutputChunk(path=rel, error=f"cannot read {path}: {exc.strerror}")


def slice_files(state_dir: str, spec: pb.JobSpec, credentials: Credentials
                ) -> Iterator[pb.OutputChunk]:
    """Every host's output files of a job: this gateway's, then each peer's."""
    yield from own_files(state_dir, spec.job_id)
    for address in dict.fromkeys(spec.hosts[1:]):
        try:
            yield from stub(address, credentials).OutputFiles(
                pb.OutputsRequest(job_id=spec.job_id, this_host=True),
                metadata=credentials.metadata, timeout=3600)
        except grpc.RpcError as exc:
            yield pb.OutputChunk(error=f"could not collect the output files of the agent at "
                                       f"{address}: {exc.code().name}: {exc.details()}")
