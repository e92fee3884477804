"""The argument cache: large buffers of calls, by content digest.

A call's large buffers (a big array's bytes) travel apart from the rest of its
payload (``JobSpec.blobs``). The client asks the gateway which it holds
(``HaveBlobs``) and sends only the others (``PutBlob``); the gateway passes each
chunk on to the slice's other agents as it arrives (cut-through, as a tree:
each agent sends to at most ``FAN_OUT`` others, which forward to the rest), so
no agent waits for a whole buffer before passing it on, and the gateway sends
each byte at most ``FAN_OUT`` times whatever the number of hosts. A notebook
that calls ``train(dataset)`` twice uploads the dataset once.

Each agent keeps its buffers in memory (``/dev/shm``, where it has 1 GiB or
more: written to a disk, a few GiB of buffers waited on its write-back, and the
cache need not outlive the agent), else in ``state_dir/blobs``; ``--cache-dir``
chooses. It is emptied when the agent starts and removed when it stops; an
agent that starts also removes the memory caches of this user's agents that
died without removing theirs. It holds up to ``max_bytes``, least recently used
out first. A buffer a queued or running job needs is pinned and
never evicted; when pinned buffers alone fill the cache a new one is refused,
saying so. A worker maps its job's buffers from here (copy-on-write: the
arrays unpickled from them use the page cache's pages, and stay writable).
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import logging
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from remote_tpu._core import digests
from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.limits import CHUNK_SIZE, upload_deadline
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from ._cache_dir import OWNER_FILE, sweep_orphans

log = logging.getLogger(__name__)

FAN_OUT = 4            # agents each agent passes a buffer on to
_QUEUED_CHUNKS = 16    # per onward agent: a slow one holds back the upload, not memory


class CacheFull(Exception):
    """The cache cannot take a buffer (pinned buffers fill it, or the disk is full)."""


class BlobCache:
    def __init__(self, directory: str, max_bytes: int) -> None:
        self.dir = directory
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        with open(os.path.join(self.dir, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        sweep_orphans(self.dir)
        # Large return values land here first (in memory, like the buffers),
        # on their way to their job's directory (JobRecord.keep_result).
        self.results_dir = os.path.join(self.dir, "results")
        os.makedirs(self.results_dir, mode=0o700, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU
        self._pins: collections.Counter[bytes] = collections.Counter()
        self._bytes = 0

    def close(self) -> None:
        """The agent stops: the cache (memory, in /dev/shm) goes with it."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, digest: bytes) -> str:
        return os.path.join(self.dir, digest.hex())

    def has(self, ref: pb.BlobRef) -> bool:
        with self._lock:
            size = self._sizes.get(ref.digest)
            if size is None or size != ref.size:
                return False
            self._sizes.move_to_end(ref.digest)
            return True

    def pin(self, refs: Sequence[pb.BlobRef]) -> list[str] | None:
        """Keep these buffers until ``unpin``: their files' paths; None (and
        nothing pinned) when one of them is not here."""
        with self._lock:
            if any(self._sizes.get(r.digest) != r.size for r in refs):
                return None
            for ref in refs:
                self._pins[ref.digest] += 1
                self._sizes.move_to_end(ref.digest)
            return [self.path(r.digest) for r in refs]

    def unpin(self, refs: Sequence[pb.BlobRef]) -> None:
        with self._lock:
            for ref in refs:
                if self._pins.get(ref.digest, 0) > 0:
                    self._pins[ref.digest] -= 1
                    if not self._pins[ref.digest]:
                        del self._pins[ref.digest]
            self._evict(0)

    def missing(self, refs: Sequence[pb.BlobRef]) -> list[pb.BlobRef]:
        return [r for r in refs if not self.has(r)]

    def _evict(self, room: int) -> bool:
        """(Lock held.) Make ``room`` bytes of space; whether it could be made
        (when it cannot, nothing is evicted)."""
        pinned = sum(size for digest, size in self._sizes.items() if self._pins.get(digest))
        unsettled = self._bytes - sum(self._sizes.values())     # buffers still arriving
        if pinned + unsettled + room > self.max_bytes:
            return False
        for digest in list(self._sizes):
            if self._bytes + room <= self.max_bytes:
                return True
            if self._pins.get(digest):
                continue
            self._bytes -= self._sizes.pop(digest)
            try:
                os.unlink(self.path(digest))
            except OSError:
                pass
        return self._bytes + room <= self.max_bytes

    def _reserve(self, size: int) -> None:
        with self._lock:
            if size > self.max_bytes:
                raise CacheFull(f"a buffer of {size:,} bytes is larger than its whole "
                                f"argument cache (--cache-bytes {self.max_bytes:,})")
            if not self._evict(size):
                raise CacheFull(
                    f"its argument cache (--cache-bytes {self.max_bytes:,}) cannot take "
                    f"{size:,} more bytes now: the buffers of queued and running jobs, and "
                    f"of uploads under way, fill it. Wait for them to end, or start the "
                    f"agent with a larger --cache-bytes")
            self._bytes += size       # held for it while it arrives

    def _release(self, size: int) -> None:
        with self._lock:
            self._bytes -= size

    def _add(self, ref: pb.BlobRef, tmp: str) -> None:
        with self._lock:
            os.replace(tmp, self.path(ref.digest))
            if ref.digest in self._sizes:        # sent twice at once: one copy
                self._bytes -= ref.size
            self._sizes[ref.digest] = ref.size
            self._sizes.move_to_end(ref.digest)

    # ----------------------------------------------------------- receiving

    def receive(self, chunks: Iterator[pb.BlobChunk], credentials: Credentials,
                slice_peers: Callable[[], list[str]]) -> pb.BlobStored:
        """Store the buffer ``chunks`` bring, passing each chunk on to the
        agents its first message names (or this slice's others) as it arrives;
        why it could not be stored here, and where it could not be passed on."""
        first = next(chunks, None)
        if first is None or not first.HasField("blob") or len(first.blob.digest) != digests.SIZE:
            raise ValueError("PutBlob must start with the buffer's digest and size")
        ref = first.blob
        onward = _Onward(ref, list(first.forward_to) or (
            slice_peers() if first.to_slice else []), credentials)
        refused = ""
        try:
            self._store(ref, first.data, chunks, onward)
        except (CacheFull, ValueError, OSError) as exc:
            refused = str(exc)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                refused = f"no space left in {self.dir}"
            onward.abort()
        except BaseException:           # the sender went away mid-buffer: so do the sends
            onward.abort()
            onward.finish()
            raise
        return pb.BlobStored(refused=refused, onward_failed=onward.finish())

    def _store(self, ref: pb.BlobRef, data: bytes, chunks: Iterator[pb.BlobChunk],
               onward: _Onward) -> None:
        if self.has(ref):                      # already here: only pass it on
            self._pass_on(ref, data, chunks, onward, None)
            return
        self._reserve(ref.size)
        tmp = ""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".incoming-")
            with os.fdopen(fd, "wb") as f:
                self._pass_on(ref, data, chunks, onward, f)
            self._add(ref, tmp)
        except BaseException:
            self._release(ref.size)
            if tmp:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise

    def _pass_on(self, ref: pb.BlobRef, data: bytes, chunks: Iterator[pb.BlobChunk],
                 onward: _Onward, f) -> None:
        digest = digests.new()
        received = 0
        while True:
            if data:
                received += len(data)
                if received > ref.size:
                    raise ValueError(f"more than the announced {ref.size:,} bytes")
                onward.put(data)
                if f is not None:
                    f.write(data)
                digest.update(data)
            if received == ref.size:
                break
            chunk = next(chunks, None)
            if chunk is None:
                raise ValueError(f"the buffer ended after {received:,} of {ref.size:,} bytes")
            data = chunk.data
        if digest.digest() != ref.digest:
            raise ValueError(f"the buffer does not match its {digests.NAME} digest: it was "
                             "corrupted on the way")


class _Onward:
    """The agents a buffer is passed on to: groups of ``forward_to``, each
    sent the chunks by its own thread (so one slow agent does not stall the
    others), the first of each group asked to forward to the rest of it."""

    def __init__(self, ref: pb.BlobRef, addresses: list[str], credentials: Credentials) -> None:
        self._ref = ref
        self._credentials = credentials
        groups = [addresses[i::FAN_OUT] for i in range(min(FAN_OUT, len(addresses)))]
        self._sends = [_Send(group[0], group[1:], ref, credentials) for group in groups]

    def put(self, data: bytes) -> None:
        for send in self._sends:
            send.put(data)

    def abort(self) -> None:
        for send in self._sends:
            send.abort()

    def finish(self) -> list[str]:
        failed = []
        for send in self._sends:
            failed.extend(send.finish())
        return failed


class _Send:
    def __init__(self, address: str, rest: list[str], ref: pb.BlobRef,
                 credentials: Credentials) -> None:
        self.address = address
        self._rest = rest
        self._ref = ref
        self._credentials = credentials
        self._chunks: queue.Queue = queue.Queue(_QUEUED_CHUNKS)
        self._dead = threading.Event()
        self._reply: pb.BlobStored | None = None
        self._error = ""
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"blob-to-{address}")
        self._thread.start()

    def _requests(self) -> Iterator[pb.BlobChunk]:
        yield pb.BlobChunk(blob=self._ref, forward_to=self._rest)
        while not self._dead.is_set():     # (an agent that refused early reads no more)
            try:
                data = self._chunks.get(timeout=0.5)
            except queue.Empty:
                continue
            if data is None:
                return
            yield pb.BlobChunk(data=data)

    def _run(self) -> None:
        try:
            self._reply = stub(self.address, self._credentials).PutBlob(
                self._requests(), metadata=self._credentials.metadata,
                timeout=upload_deadline(self._ref.size))
        except grpc.RpcError as exc:
            self._error = f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # noqa: BLE001 - a bad address, say: reported, not lost
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._dead.set()

    @property
    def dead(self) -> bool:
        """The call is over (refused, failed or done): it takes no more."""
        return self._dead.is_set()

    def put(self, data: bytes | None) -> None:
        while not self._dead.is_set():
            try:
                self._chunks.put(data, timeout=0.5)
                return
            except queue.Full:
                continue

    def abort(self) -> None:
        self._error = self._error or "the upload was abandoned"
        self.put(None)            # ends the stream short: the agent there refuses it

    def finish(self) -> list[str]:
        self.put(None)
        self._thread.join()
        if self._reply is not None:
            return _failures(self.address, self._reply)
        return [f"{self.address}: {self._error}"] + [
            f"{a}: not reached ({self.address} failed)" for a in self._rest]


def _failures(address: str, reply: pb.BlobStored) -> list[str]:
    return ([f"{address}: {reply.refused}"] if reply.refused else []) + \
        list(reply.onward_failed)


def send_file(address: str, ref: pb.BlobRef, path: str, credentials: Credentials
              ) -> list[str]:
    """Send one cached buffer (its file) to the agent at ``address``; what failed."""
    send = _Send(address, [], ref, credentials)
    with open(path, "rb") as f:
        while not send.dead and (chunk := f.read(CHUNK_SIZE)):
            send.put(chunk)
    return send.finish()


def ensure_on(addresses: Sequence[str], refs: Sequence[pb.BlobRef], cache: BlobCache,
              credentials: Credentials) -> dict[str, str]:
    """Before a job starts on these agents: each holds every buffer of it
    (those it lacks, evicted or never passed on, are sent from this agent's
    cache, all agents at once). What could not be done, by address."""
    if not refs or not addresses:
        return {}

    def one(address: str) -> str:
        try:
            present = stub(address, credentials).HaveBlobs(
                pb.BlobQuery(blobs=refs), timeout=30, metadata=credentials.metadata).present
        except grpc.RpcError as exc:
            return f"could not ask for the call's buffers: {exc.code().name}: {exc.details()}"
        for ref, there in zip(refs, present):
            if there:
                continue
            failed = send_file(address, ref, cache.path(ref.digest), credentials)
            if failed:
                return f"could not receive the call's arguments: {'; '.join(failed)}"
        return ""

    unique = list(dict.fromkeys(addresses))
    with concurrent.futures.ThreadPoolExecutor(len(unique)) as pool:
        problems = dict(zip(unique, pool.map(one, unique)))
    return {address: why for address, why in problems.items() if why}
