"""The argument cache: large buffers of calls, by content digest.

A call's large buffers (a big array's bytes) travel apart from the rest of its
payload (``JobSpec.blobs``). The client asks the gateway which it holds
(``HaveBlobs``) and sends only the others: over the gateway's data port
(``OpenBlob``, then plain TCP: ``wire.data_port``), or with ``PutBlob`` where it
cannot reach it or TLS is on. The gateway passes each
chunk on to the slice's other agents as it arrives (cut-through, as a tree:
each agent sends to at most ``FAN_OUT`` others, which forward to the rest), so
no agent waits for a whole buffer before passing it on, and the gateway sends
each byte at most ``FAN_OUT`` times whatever the number of hosts. A notebook
that calls ``train(dataset)`` twice uploads the dataset once.

Each agent keeps its buffers in memory (``/dev/shm``, where it has 1 GiB or
more: written to a disk, a few GiB of buffers waited on its write-back, and the
cache need not outlive the agent), else in ``state_dir/blobs``; ``--cache-dir DIR``
chooses (a directory of its own inside DIR: what else DIR holds is never
touched). It is emptied when the agent starts and removed when it stops; an
agent that starts also removes the memory caches of this user's agents that
died without removing theirs. It holds up to ``max_bytes``, least recently used
out first. A buffer a queued or running job needs is pinned and
never evicted; when pinned buffers alone fill the cache a new one is refused,
saying so. A worker maps its job's buffers from here (copy-on-write: the
arrays unpickled from them use the page cache's pages, and stay writable).
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence

from remote_tpu._core import data_wire, digests
from remote_tpu._core.channels import Credentials
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.host.blob_sends import Onward
from remote_tpu_agent.host.cache_dir import OWNER_FILE, sweep_orphans

log = logging.getLogger(__name__)



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
        if not refs:
            return []                # (most calls: no lock, no walk)
        with self._lock:
            if any(self._sizes.get(r.digest) != r.size for r in refs):
                return None
            for ref in refs:
                self._pins[ref.digest] += 1
                self._sizes.move_to_end(ref.digest)
            return [self.path(r.digest) for r in refs]

    def unpin(self, refs: Sequence[pb.BlobRef]) -> None:
        if not refs:
            return                   # nothing freed: nothing to evict either
        with self._lock:
            for ref in refs:
                if self._pins.get(ref.digest, 0) > 0:
                    self._pins[ref.digest] -= 1
                    if not self._pins[ref.digest]:
                        del self._pins[ref.digest]
            self._evict(0)

    def missing(self, refs: Sequence[pb.BlobRef]) -> list[pb.BlobRef]:
        return [r for r in refs if not self.has(r)]

    def too_small(self, refs: Sequence[pb.BlobRef]) -> str:
        """Why these buffers can never all be here at once ("" if they can):
        each pushes another out as it arrives, whatever is tried again."""
        need = sum({r.digest: r.size for r in refs}.values())
        if need <= self.max_bytes:
            return ""
        return (f"its argument cache (--cache-bytes {self.max_bytes:,}) is smaller than the "
                f"{need:,} bytes of buffers the call needs there at once: start it with "
                f"--cache-bytes {need} or more (give every agent of a slice the same)")

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
        """PutBlob: store the buffer ``chunks`` bring (see ``take``)."""
        first = next(chunks, None)
        if first is None or not first.HasField("blob"):
            raise ValueError("PutBlob must start with the buffer's digest and size")
        check_ref(first.blob)
        pieces = itertools.chain([first.data], (chunk.data for chunk in chunks))
        return self.take(first, pieces, credentials, slice_peers)

    def receive_raw(self, sock: socket.socket, request: pb.BlobChunk,
                    credentials: Credentials, slice_peers: Callable[[], list[str]]) -> bytes:
        """The data port: store the buffer ``request`` (OpenBlob) named, its
        bytes read from ``sock``; the reply to send."""
        incoming = data_wire.Incoming(sock, request.blob.size,
                                      reuse=not (request.forward_to or request.to_slice))
        alive = data_wire.Heartbeat(sock)     # (passing it on may take a while)
        try:
            stored = self.take(request, iter(incoming), credentials, slice_peers)
            if stored.refused:
                incoming.drain()             # so that the sender reads why, not a reset
        finally:
            alive.stop()
        return stored.SerializeToString()

    def take(self, request: pb.BlobChunk, pieces: Iterator[bytes | bytearray],
             credentials: Credentials, slice_peers: Callable[[], list[str]]
             ) -> pb.BlobStored:
        """Store the buffer ``request.blob`` whose bytes ``pieces`` bring,
        passing each piece on to the agents it names (or this slice's others)
        as it arrives; why it could not be stored here, and where it could not
        be passed on."""
        ref = request.blob
        onward = Onward(ref, list(request.forward_to) or (
            slice_peers() if request.to_slice else []), credentials)
        refused = ""
        try:
            self._store(ref, pieces, onward)
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

    def _store(self, ref: pb.BlobRef, pieces: Iterator[bytes | bytearray],
               onward: Onward) -> None:
        if self.has(ref):                      # already here: only pass it on
            self._pass_on(ref, pieces, onward, None)
            return
        self._reserve(ref.size)
        tmp = ""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".incoming-")
            with os.fdopen(fd, "wb") as f:
                self._pass_on(ref, pieces, onward, f)
            self._add(ref, tmp)
        except BaseException:
            self._release(ref.size)
            if tmp:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise

    def _pass_on(self, ref: pb.BlobRef, pieces: Iterator[bytes | bytearray],
                 onward: Onward, f) -> None:
        digest = digests.new()
        received = 0
        for data in pieces:
            if not data:
                continue
            received += len(data)
            if received > ref.size:
                raise ValueError(f"more than the announced {ref.size:,} bytes")
            onward.put(data)
            if f is not None:
                f.write(data)
            digest.update(data)
            if received == ref.size:
                break
        if received != ref.size:
            raise ValueError(f"the buffer ended after {received:,} of {ref.size:,} bytes")
        if digest.digest() != ref.digest:
            raise ValueError(f"the buffer does not match its {digests.NAME} digest: it was "
                             "corrupted on the way")


def check_ref(ref: pb.BlobRef) -> None:
    if len(ref.digest) != digests.SIZE:
        raise ValueError(f"a buffer is named by its {digests.SIZE}-byte {digests.NAME} "
                         f"digest, not by {len(ref.digest)} bytes")
