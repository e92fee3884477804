"""A caller's lane: a warm session's caller sends its next calls to the gateway
on one plain TCP connection (the gateway's data port) instead of ``RunInline``.

A gRPC call costs the caller, and the gateway as much, more CPU than the rest
of a warm call on the caller's side (figures: benchmarks/README.md, from
``benchmarks/transport_floor.py``). The caller asks for a lane (``JobSpec.offer_lane``); a call
that leaves its warm session going ends with a ticket for it (``JobEnd.lane``),
handed out on the gRPC call, where the token was checked. On the lane:

- the caller sends ``CALL`` (what ``RunInline``'s one request would be), and
  gets the call's events (``EVENT``) and then ``END``, or ``ERROR`` (what the
  call was refused with: its status code, details and error kind, as JSON);
- ``CANCEL``, or the caller closing the connection, cancels the running call,
  as a gRPC caller that goes away does; a lane that breaks under a call
  cancels it unless its caller sends it again on gRPC (``RESEND_SECONDS``);
- one call at a time, each under an id of the caller's (its frames carry it:
  ``remote_tpu._core.frame_connection``, every side channel's connection);
- a lane idle for ``IDLE_SECONDS`` is closed by the gateway;
- a caller gone (its host, or the network to it) cancels its call: see
  ``SILENCE_SECONDS``.

The call itself is served exactly as ``RunInline`` serves it (``run``), with a
context that does what that needs of gRPC's (``LaneContext``).
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core.channels import ERROR_KIND_KEY
from remote_tpu._core import data_wire
from remote_tpu._core.frame_connection import FrameConnection
from remote_tpu._core.proto import remote_tpu_pb2 as pb

log = logging.getLogger(__name__)

CALL, CANCEL, EVENT, END, ERROR = (data_wire.CALL, data_wire.CANCEL, data_wire.EVENT,
                                   data_wire.END, data_wire.ERROR)   # (protos/: FrameKind)

# A lane no call came on for this long is closed (each holds one of the data
# port's connections): the caller's next call goes on gRPC, and is offered a new one.
IDLE_SECONDS = 600.0
# A caller whose host is gone (or the network to it cut) counts as gone, and its
# call is cancelled, as the agent's gRPC keepalive finds such callers: after
# SILENCE_SECONDS when nothing sent to it waits (TCP keepalive probes), else
# once its kernel has left what was sent, or our probes of its full window,
# unacknowledged for UNANSWERED_SECONDS (``_unanswered``). A caller that only
# stops reading (its output piped to a slow reader, as gRPC waits for; even its
# process stopped) is still answered for by its kernel, and is waited for.
SILENCE_SECONDS = 3.0
UNANSWERED_SECONDS = 10.0
# A lane that breaks (a reset, or a caller gone silent) rather than being closed
# by its caller may have broken on the way: a caller that sees it break before
# its call's first event sends the call again on gRPC under the same job id,
# which follows the running call. The call is cancelled only if no such resend
# comes within this time (a caller that closes its lane, or is killed, is gone
# at once: its kernel says goodbye).
RESEND_SECONDS = 2.0

RunCall = Callable[[pb.RunRequest, "LaneContext"], Iterator[pb.Event]]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class LaneContext:
    """What serving a call needs of a gRPC servicer context."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._active = True
        self.trailing: tuple = ()
        # The lane broke under the call (its caller may send it again on gRPC:
        # see RESEND_SECONDS), rather than its caller closing it.
        self.broken = False

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` when the call ends; at once if it has (its caller
        went away before the call got this far: what the callback does for a
        caller that goes away must still be done)."""
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
                return True
        callback()
        return False

    def is_active(self) -> bool:
        return self._active

    def end(self) -> None:
        """The call is over, or its caller went away: its callbacks run, once."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._active = False
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - every callback runs
                log.exception("a lane call's callback failed")


def serve_call(events: Iterator[pb.Event], context: LaneContext,
               send: Callable[..., None]) -> bool:
    """Send a call's events (``send(kind, body)``), then ``END``; or ``ERROR``:
    what it was refused with, as gRPC would say it. False once the connection
    broke (``send`` raised OSError)."""
    try:
        try:
            for event in events:
                send(EVENT, event.SerializeToString())
            send(END)
        except _Aborted as exc:
            kind = dict(context.trailing).get(ERROR_KIND_KEY, "")
            send(ERROR, data_wire.LaneError(exc.code, exc.details, kind).body())
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - said to the caller, as gRPC would
            log.exception("a call on a lane failed")
            send(ERROR, data_wire.LaneError(grpc.StatusCode.INTERNAL, str(exc)).body())
    except OSError as exc:
        log.info("a lane broke during a call: %s", exc)
        return False
    finally:
        close = getattr(events, "close", None)
        if close is not None:            # (its clean-up now, not when it is collected)
            close()
    return True


def offering(spec: pb.JobSpec, events: Iterator[pb.Event], data_port,
             warm_owner: Callable[[], str], run: RunCall) -> Iterator[pb.Event]:
    """A call's events; its end, when it leaves its caller's warm session
    going, with a ticket for a lane on ``data_port`` that ``run`` serves."""
    for event in events:
        if data_port is not None and event.HasField("end") and \
                (event.end.state == pb.JOB_STATE_SUCCEEDED or event.end.warm_kept) and \
                spec.client_id and \
                warm_owner() == spec.client_id:
            ticket = data_port.issue(CallLane(run).serve, lane=True)
            if ticket is not None:
                offered = pb.Event()
                offered.CopyFrom(event)
                offered.end.lane.CopyFrom(pb.DataTicket(
                    port=data_port.port, nonce=data_port.nonce, ticket=ticket))
                event = offered
        yield event


class CallLane:
    """One caller's lane: this (the data port's connection) thread reads what
    the caller sends; a runner thread of the lane's own serves each call."""

    def __init__(self, run: RunCall) -> None:
        self._run = run
        self._calls: queue.Queue[tuple[int, pb.RunRequest] | None] = queue.Queue()
        self._current: LaneContext | None = None
        self._pending = 0              # calls sent and not yet over
        self._idle_since = time.monotonic()     # when the last of them was over
        self._gone = False             # the caller went away: no call of it starts
        self._lock = threading.Lock()
        self._unanswered_since: float | None = None

    def serve(self, sock: socket.socket) -> bytes:
        conn = FrameConnection(sock, (CALL, CANCEL), silence=SILENCE_SECONDS,
                               bound_unacked=False)
        runner = threading.Thread(target=self._runner, args=(conn,), daemon=True,
                                  name="call-lane")
        runner.start()
        poll = select.poll()
        poll.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)

        def ending() -> None:
            if conn.broken:
                log.info("a caller's lane broke: %s", conn.why)
            with self._lock:
                self._gone = True
            self._calls.put(None)
            self._cancel(conn.broken)      # a caller that went away: as on gRPC
        try:
            conn.serve(self._frame, lambda: self._ready(poll, sock), ending)
        finally:
            runner.join()
        return b""

    def _ready(self, poll: select.poll, sock: socket.socket) -> bool:
        """Whether the caller's next frame has come (False: the lane is over,
        idle); between its frames, a call whose output the caller's kernel
        leaves unanswered for ``UNANSWERED_SECONDS`` breaks it."""
        while (wait := self._wait()) > 0:
            if poll.poll(wait * 1000):
                return True
            if not self._pending_calls():
                continue
            if not _unanswered(sock):
                self._unanswered_since = None
            elif self._unanswered_since is None:
                self._unanswered_since = time.monotonic()
            elif time.monotonic() - self._unanswered_since >= UNANSWERED_SECONDS:
                raise ConnectionError(f"it went unanswered for {UNANSWERED_SECONDS:g} s "
                                      "during a call: taken as broken")
        return False

    def _frame(self, kind: int, call_id: int, body: bytes) -> None:
        if kind == CALL:
            request = pb.RunRequest.FromString(body)
            with self._lock:
                self._pending += 1
            self._calls.put((call_id, request))
        else:                          # CANCEL
            self._cancel()

    def _wait(self) -> float:
        """How long to wait for the caller's next frame: while a call is on
        the lane, a second (then ``_unanswered`` is asked); 0 once no call came
        on it for ``IDLE_SECONDS``."""
        with self._lock:
            pending, idle_since = self._pending, self._idle_since
        if pending:
            return 1.0
        left = IDLE_SECONDS - (time.monotonic() - idle_since)
        if left <= 0:
            log.info("a caller's lane was idle for %g s: closed", IDLE_SECONDS)
        return max(left, 0)

    def _pending_calls(self) -> int:
        with self._lock:
            return self._pending

    def _cancel(self, broken: bool = False) -> None:
        with self._lock:
            context = self._current
        if context is not None:
            context.broken = broken
            context.end()

    def _runner(self, conn: FrameConnection) -> None:
        while (call := self._calls.get()) is not None:
            call_id, request = call
            context = LaneContext()
            with self._lock:
                if self._gone:             # sent, then the caller went away
                    self._pending -= 1
                    continue
                self._current = context
            try:
                if not serve_call(self._run(request, context), context,
                                  lambda kind, body=b"": conn.send(kind, call_id, body)):
                    return               # the caller went away: serve() sees it too
            finally:
                with self._lock:
                    self._current = None
                    self._pending -= 1
                    self._idle_since = time.monotonic()
                context.end()


def _unanswered(sock: socket.socket) -> bool:
    """Whether the caller's kernel leaves what we sent it unacknowledged now:
    retransmissions, or probes of its full window, unanswered (Linux's
    TCP_INFO; elsewhere the kernel's own limits end such a connection)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, 8)
    except OSError:
        return False
    _state, _ca_state, retransmits, probes = struct.unpack_from("4B", info)
    return retransmits > 0 or probes > 0
