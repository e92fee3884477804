"""How an attached call gets to its gateway, up to its first event: one
interface (``Transport``), two kinds of way, one rule.

- the frame way: this process's lane to the gateway (``_call_lane``), a warm
  session's next call whose payload goes inside its spec;
- gRPC: ``RunInline`` (a payload that goes inside the spec), then ``Run``
  (any call; the way of last resort).

The rule: the ways are tried in that order, and one that cannot take the call
says so (None) before anything of it ran, and the next is tried; a way beside
gRPC that could not be used is left alone for a while (``data_wire.Backoff``,
through ``data_wire.worth_trying``). A way that can take the call raises what
its gateway refused it with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from . import _call_lane as call_lane
from ._core.limits import INLINE_BYTES
from ._core.proto import remote_tpu_pb2 as pb
from ._core.serialization import Payload

if TYPE_CHECKING:
    from ._status import LiveStatus
    from ._target import Target


class Stream(Protocol):
    """A call's events, read as a gRPC stream's are; ``cancel`` ends the call."""

    def __iter__(self) -> Iterator[pb.Event]: ...

    def cancel(self) -> None: ...


class Transport(Protocol):
    """One way to the gateway: ``start`` sends the call (``on_sent`` once it
    surely got there) and reads up to its first event; None where this way
    cannot take it (the next one is tried)."""

    def start(self, target: Target, spec: pb.JobSpec, payload: Payload,
              status: LiveStatus | None, on_sent: Callable[[], None]) -> Stream | None: ...


def requests(spec: pb.JobSpec, payload: Payload,
             status: LiveStatus | None = None) -> Iterator[pb.RunRequest]:
    """A call's requests: its spec carrying the payload where it is small
    enough (one message), else the spec and then the payload in chunks."""
    if payload.nbytes <= INLINE_BYTES:            # one message: the spec carries it
        inline = pb.JobSpec()
        inline.CopyFrom(spec)
        inline.payload = payload.to_bytes()
        yield pb.RunRequest(spec=inline)
        return
    yield pb.RunRequest(spec=spec)
    sent, started = 0, time.monotonic()
    for chunk in payload.chunks():
        if status is not None:
            status.uploading(sent, payload.nbytes, started)
        sent += len(chunk)
        yield pb.RunRequest(payload_chunk=chunk)


class LaneTransport:
    """The frame way: this process's lane to the gateway (``_call_lane``)."""

    def start(self, target: Target, spec: pb.JobSpec, payload: Payload,
              status: LiveStatus | None, on_sent: Callable[[], None]) -> Stream | None:
        if not spec.offer_lane or payload.nbytes > INLINE_BYTES:
            return None
        return call_lane.start(target.gateway, target.credentials,
                               next(requests(spec, payload)), on_sent)


class StartedRun:
    """A gRPC stream whose first event was read already, handed on with it."""

    def __init__(self, stream: Any, first: pb.Event | None) -> None:
        self._stream = stream
        self._first = first

    def __iter__(self) -> Iterator[pb.Event]:
        if self._first is not None:
            yield self._first
        yield from self._stream

    def cancel(self) -> None:
        self._stream.cancel()


# Gateways that do not know RunInline (an older agent): they get Run.
without_run_inline: set[str] = set()


class GrpcTransport:
    """gRPC: ``RunInline`` (``inline``: a payload that goes inside the spec, to
    a gateway that knows it) or ``Run``. ``stub.Run`` only starts the call: a
    refused connection surfaces when the stream is first read, so that read
    belongs to the attempt; once an event has arrived, nothing is retried.
    Each attempt sends the payload from its start."""

    def __init__(self, inline: bool) -> None:
        self._inline = inline

    def start(self, target: Target, spec: pb.JobSpec, payload: Payload,
              status: LiveStatus | None, on_sent: Callable[[], None]) -> Stream | None:
        stub, metadata = target.stub(), target.credentials.metadata
        if self._inline:
            if payload.nbytes > INLINE_BYTES or target.gateway in without_run_inline:
                return None
            stream = stub.RunInline(next(requests(spec, payload)), metadata=metadata)
        else:
            stream = stub.Run(requests(spec, payload, status), metadata=metadata)
        try:
            first = next(stream, None)
        except grpc.RpcError as exc:
            if not (self._inline and exc.code() == grpc.StatusCode.UNIMPLEMENTED):
                raise
            without_run_inline.add(target.gateway)
            return None                               # (Run, next)
        except BaseException:
            stream.cancel()          # Ctrl-C before the first event: the job stops too
            raise
        return StartedRun(stream, first)


# The ways, in the order they are tried: the frame way, then gRPC's.
TRANSPORTS: tuple[Transport, ...] = (LaneTransport(), GrpcTransport(inline=True),
                                     GrpcTransport(inline=False))


def start(target: Target, spec: pb.JobSpec, payload: Payload, status: LiveStatus | None,
          on_try: Callable[[Transport], Callable[[], None]],
          transports: tuple[Transport, ...] = TRANSPORTS) -> Stream:
    """The call on the first of ``transports`` that takes it, up to its first
    event; ``on_try(transport)`` is told before each is tried, and returns what
    that one calls once the call surely got there."""
    for transport in transports:
        stream = transport.start(target, spec, payload, status, on_try(transport))
        if stream is not None:
            return stream
    raise AssertionError("Run takes every call")
