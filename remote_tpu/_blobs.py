"""A call's large buffers, sent apart and only when the slice lacks them.

A buffer of ``BLOB_MIN`` bytes or more (a big array's data) leaves the
payload: the gateway is asked which of them its argument cache holds
(``HaveBlobs``), the others are sent (``PutBlob``, each passed on by the agents
to the whole slice as it arrives), and the job spec names them all by content
digest. Calling ``train(dataset)`` twice with the same array sends it once.
Where the gateway keeps no cache (``--cache-bytes 0``), or cannot take a
buffer now, the call carries its buffers in its payload, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ._core import data_wire
from ._core.limits import CHUNK_SIZE
from ._core.proto import remote_tpu_pb2 as pb
from ._core.serialization import Payload
from ._core.limits import upload_deadline
from ._target import Target

BLOB_MIN = 1 << 20       # the same as an inline payload's limit: smaller ones travel in it
sent_bytes = [0]         # buffer bytes this process has sent (PutBlob), all told


Progress = Callable[[int], None]       # bytes of the buffers being sent, so far


def _chunks(ref: pb.BlobRef, blob: memoryview, target: Target,
            progress: Progress | None = None) -> Iterator[pb.BlobChunk]:
    forward = list(target.hosts[1:])
    yield pb.BlobChunk(blob=ref, forward_to=forward, to_slice=not forward)
    view = data_wire.byte_view(blob)
    for start in range(0, view.nbytes, CHUNK_SIZE):
        if progress is not None:
            progress(start)
        yield pb.BlobChunk(data=view[start:start + CHUNK_SIZE].tobytes())


def _put(target: Target, ref: pb.BlobRef, blob: memoryview,
         progress: Progress | None) -> pb.BlobStored:
    """One buffer to the gateway: over its data port where this machine reaches
    it (no copy of the buffer here), else with PutBlob."""
    forward = list(target.hosts[1:])
    request = pb.BlobChunk(blob=ref, forward_to=forward, to_slice=not forward)
    try:
        stored = data_wire.put_blob(target.stub(), target.gateway, target.credentials,
                                    request, lambda sock: data_wire.send_view(
                                        sock, blob, progress))
    except ConnectionError:           # broke on the way: gRPC says why, or gets it there
        stored = None
    if stored is not None:
        return stored
    return target.stub().PutBlob(_chunks(ref, blob, target, progress),
                                 timeout=upload_deadline(ref.size),
                                 metadata=target.credentials.metadata)


def send(target: Target, payload: Payload,
         progress: Callable[[int, int], None] | None = None, beside: int = 0
         ) -> list[pb.BlobRef] | None:
    """Make sure the gateway holds every buffer ``payload`` left apart: their
    references for the job spec; None when they must travel in the payload
    instead (no cache there, it cannot take them now, or not beside the
    ``beside`` bytes of the call's trees, which must stay there too)."""
    refs = [pb.BlobRef(digest=d, size=b.nbytes)
            for d, b in zip(payload.blob_digests(), payload.blobs)]
    why = send_buffers(target, refs, [lambda b=b: b for b in payload.blobs], progress,
                       beside)
    return None if why else refs


def capacity(target: Target) -> int:
    """The most bytes the gateway's argument cache holds (0: it keeps none)."""
    return _have(target, []).capacity


def _have(target: Target, refs: list[pb.BlobRef]) -> pb.BlobPresence:
    return target.call(lambda t: t.stub().HaveBlobs(
        pb.BlobQuery(blobs=refs), timeout=60, metadata=t.credentials.metadata), retry=True)


def send_buffers(target: Target, refs: list[pb.BlobRef],
                 data: list[Callable[[], bytes | memoryview]],
                 progress: Callable[[int, int], None] | None = None, beside: int = 0
                 ) -> str:
    """Make sure the gateway holds every buffer of ``refs``, sending those it
    lacks (``data[i]()`` gives the bytes of ``refs[i]``); why its cache cannot
    take them all, with ``beside`` bytes of others that must stay there too
    ("" once it holds them). ``progress(sent, total)``: the bytes sent so far
    of those it lacked."""
    reply = _have(target, refs)
    need = sum({ref.digest: ref.size for ref in refs}.values()) + beside
    if need > reply.capacity:                    # they could not all stay there at once
        return (f"{need:,} bytes of buffers at once, and it holds at most "
                f"{reply.capacity:,} (--cache-bytes {reply.capacity})")
    sent: set[bytes] = set()
    total = sum({r.digest: r.size for r, p in zip(refs, reply.present) if not p}.values())
    before = 0                  # bytes of the buffers already sent by this call
    for ref, get, present in zip(refs, data, reply.present):
        if present or ref.digest in sent:
            continue
        blob = memoryview(get())
        moved = None if progress is None else (
            lambda n, base=before: progress(base + n, total))
        stored = target.call(lambda t: _put(t, ref, blob, moved), retry=True)
        before += ref.size
        if stored.refused:
            return stored.refused
        sent.add(ref.digest)
        sent_bytes[0] += ref.size
        # A peer that could not take it (stored.onward_failed) is sent it again
        # by the gateway as the job starts, or the job fails naming that host.
    return ""
