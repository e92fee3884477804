"""One call to a peer's agent on gRPC's ``Run`` (``GrpcCall``), driven the way
a call on the gateway's link to that peer is (``peer_link.LinkCall``): requests
sent as they come, its events and its end handed to callbacks. The two keep
one contract, ``PeerChannel`` (a warm session's lane, ``peer_lane.GatewayLane``,
too): the one way the gateway's proxy for a process on a peer
(``gateway.peer_process``) talks to it, whichever carries the call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import grpc

from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.data_wire import LaneError
from remote_tpu._core.limits import CHUNK_SIZE, INLINE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb

OnEvent = Callable[[pb.Event], None]
OnEnd = Callable[[grpc.RpcError | None], None]     # None: the peer ended the call


class PeerChannel(Protocol):
    """One call to a peer, on a link or on gRPC: ``send`` a request (False
    once it cannot be sent), ``close`` (no more requests), ``cancel`` (end it:
    the peer stops its worker). Its events and its end (once) go to the
    callbacks it was opened with. A warm session's lane
    (``peer_lane.GatewayLane``) is one too, beside its ``Run`` call: it
    carries the session's next calls and their cancellation, and ending it
    ends only the lane."""

    def send(self, request: pb.RunRequest) -> bool: ...

    def close(self) -> None: ...

    def cancel(self) -> None: ...


class GrpcCall:
    """A call on gRPC's ``Run`` to the agent at ``address``: ``first`` are its
    opening requests (a payload file's path among them: sent in chunks as the
    stream goes); ``run`` (in a thread of the caller's) reads its events until
    it ends."""

    def __init__(self, address: str, credentials: Credentials,
                 first: Iterable[pb.RunRequest | str], on_event: OnEvent,
                 on_end: OnEnd) -> None:
        self._address = address
        self._credentials = credentials
        self._first = first           # (read as the stream goes: chunks are not held)
        self._on_event = on_event
        self._on_end = on_end
        self._more: queue.Queue[pb.RunRequest | str | None] = queue.Queue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._cancelled = False

    def send(self, request: pb.RunRequest | str) -> bool:
        """Queue a request (or a payload file's path) after those before it."""
        if self._closed.is_set():
            return False
        self._more.put(request)
        return True

    def close(self) -> None:
        self._closed.set()
        self._more.put(None)          # wakes ``_requests``, which then ends

    def cancel(self) -> None:
        """End the call, as gRPC's ``cancel`` does (also before it started)."""
        self.close()
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def run(self) -> None:
        """Start the call and hand its events on until it ends; then its end."""
        try:
            with self._lock:          # ``cancel`` cancels the call once it exists
                if self._cancelled:
                    raise LaneError(grpc.StatusCode.CANCELLED, "the gateway ended the call")
                self._call = stub(self._address, self._credentials).Run(
                    self._requests(), metadata=self._credentials.metadata)
            for event in self._call:
                self._on_event(event)
        except grpc.RpcError as exc:
            self._on_end(exc)
            return
        except BaseException:
            self._on_end(None)
            raise
        self._on_end(None)

    def _requests(self) -> Iterator[pb.RunRequest]:
        for item in self._first:
            yield from _sent(item)
        # (Waits without a timeout: a waking poll cost 5 wakeups a second per
        # peer at the gateway for as long as a job ran.)
        while (item := self._more.get()) is not None and not self._closed.is_set():
            yield from _sent(item)


def call_requests(spec: pb.JobSpec, payload: bytes | str, field: str
                  ) -> Iterator[pb.RunRequest | str]:
    """A call's messages: its spec (as ``field``) carrying the payload when it
    is inline, or the spec and then the payload's file (sent in chunks)."""
    if isinstance(payload, bytes) and len(payload) <= INLINE_BYTES:
        inline = pb.JobSpec()
        inline.CopyFrom(spec)
        inline.payload = payload
        yield pb.RunRequest(**{field: inline})
        return
    yield pb.RunRequest(**{field: spec})
    if isinstance(payload, bytes):
        for chunk in _chunks(payload):
            yield pb.RunRequest(payload_chunk=chunk)
    else:
        yield payload


def _sent(item: pb.RunRequest | str) -> Iterator[pb.RunRequest]:
    """A request as it is, or a payload's file streamed in chunks as it is sent."""
    if isinstance(item, pb.RunRequest):
        yield item
        return
    for chunk in _chunks(item):
        yield pb.RunRequest(payload_chunk=chunk)


def _chunks(payload: bytes | str) -> Iterator[bytes]:
    """The payload in message-sized chunks: inline, or read from its file."""
    if isinstance(payload, bytes):
        for start in range(0, len(payload), CHUNK_SIZE):
            yield payload[start:start + CHUNK_SIZE]
        return
    with open(payload, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            yield chunk
