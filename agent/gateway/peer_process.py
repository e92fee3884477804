"""The gateway's proxy for one process on a peer host: a ``Run`` call to that
host's agent (the peer role, ``peer.role``), or the same on the gateway's link to
it (``wire.peer_link``), relayed as if it were a local worker. In a warm session
the call stays open between calls and carries each next one (``next_call``),
or the session's lane does once the peer has offered one (``wire.peer_lane``); ``stop``
ends it, and so the peer's worker."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

import grpc

from remote_tpu._core import data_wire
from remote_tpu._core.exceptions import AuthenticationError, VersionMismatchError
from remote_tpu._core.channels import (Credentials, error_from_rpc, forget_if_unavailable,
                                       health, stub)
from remote_tpu._core.limits import INLINE_BYTES, OTHER_VALUE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.versions import differences, local_versions, slice_skew

from remote_tpu_agent.wire import peer_link as _peer_link
from remote_tpu_agent.wire.grpc_call import GrpcCall, PeerChannel, call_requests
from remote_tpu_agent.wire.peer_lane import SILENCE_SECONDS, GatewayLane

log = logging.getLogger(__name__)

_DIRECT_BYTES = 64 << 10


class RemoteHost:
    """Forwards the job to one peer agent and relays its events.

    A ``worker.handle.ProcessHandle``, as a ``WorkerRun`` is.

    Why over 200 lines: a call goes on the link, on gRPC or (a warm
    session's next ones) on the session's lane, all through one contract
    (``wire.grpc_call.PeerChannel``), but the lane's coming and going while
    the session's ``Run`` call lives on, and the preflight's two ways, are
    this class's own.
    """

    def __init__(self, *, host: int, address: str, spec: pb.JobSpec, payload: bytes | str,
                 emit: Callable[[pb.Event], None], credentials: Credentials) -> None:
        self.host = host
        self.address = address
        self._spec = spec
        self._payload = payload            # inline, or the path of its file
        self._emit = emit
        # Asked for before the call started: sent on it once it has.
        self._early: list[pb.RunRequest | str] = []
        self._closed = threading.Event()
        self._call: PeerChannel | None = None      # on the link, or on gRPC
        self._credentials = credentials
        self._lock = threading.Lock()
        self._exited_sent = False
        self.parked = False               # warm, between calls, its call still open
        self.finished = threading.Event()
        self._lane: GatewayLane | None = None     # the session's calls, once opened
        self._on_lane = False                     # a call sent on it has not ended
        self._silent = False                      # its link did not answer the preflight
        self.versions: pb.Versions | None = None  # its agent's, once it answered a preflight
        self._value: bytearray | None = None      # all_results=: its pickled value
        self._value_size = 0
        self._value_short = False                 # (more came than it announced)

    def preflight(self, on_link: bool = True) -> tuple[str, bool]:
        """Check, before anything runs anywhere, that the peer answers, accepts
        our credentials and speaks our protocol. Returns what is wrong (or "")
        and whether it is permanent (refused: asking again cannot help, unlike
        a peer that does not answer, as while its VM is preempted). Asked on the
        open link to the peer (``ask``), else, or where that broke, on gRPC (for
        2 s only where the link was silent); a call that will go on a link then opens one."""
        if on_link and (wait := self.ask()) is not None and (verdict := wait()):
            return verdict
        try:
            reply = health(self.address, self._credentials, attempts=1 if self._silent else 2,
                           timeout=2 if self._silent else 5)
        except (AuthenticationError, VersionMismatchError) as exc:
            return f"agent at {self.address} cannot take the job: {exc}", True
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            return f"agent at {self.address} cannot take the job: {exc}", False
        verdict = self._verdict(reply)
        if not verdict[0] and self._linkable():
            _peer_link.link_to(self.address, self._credentials)     # (for ``start``)
        return verdict

    def ask(self) -> Callable[[], tuple[str, bool] | None] | None:
        """``preflight`` begun on the open link to the peer (None: there is
        none); a function that waits for the verdict (5 s from now at most),
        None if none came (ask with ``preflight(False)``). A link silent that
        long is closed, not trusted with the call: the peer is stuck, or the
        network drops only its data port."""
        link = _peer_link.existing(self.address)
        wait = link.ask_health() if link is not None else None
        if link is None or wait is None:
            return None
        deadline = time.monotonic() + self._credentials.answer_within(5)

        def verdict() -> tuple[str, bool] | None:
            try:
                reply = wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                link.close()
                self._silent = True
                log.info("peer %d at %s: %s; asking on gRPC", self.host, self.address, exc)
                return None
            return None if reply is None else self._verdict(reply)
        return verdict

    def _verdict(self, reply: pb.HealthReply) -> tuple[str, bool]:
        self.versions = reply.versions
        problems = differences(reply.versions, there=f"on the agent at {self.address}",
                               here="on the gateway")
        problems += slice_skew({f"the agent at {self.address}": reply.versions,
                                "the gateway": local_versions()})
        if problems:
            return (f"agent at {self.address} cannot work with the gateway: "
                    + "; ".join(problems)), True
        if reply.tpu_busy:
            return f"cannot start on {self.address}: {reply.tpu_busy}", False
        return "", False

    def start(self) -> None:
        # A small call on an open link starts here (a larger one may wait for room).
        if self._linkable() and len(self._payload) <= _DIRECT_BYTES and \
                (link := _peer_link.existing(self.address)) is not None and self._start_on(link):
            return
        threading.Thread(target=self._relay, daemon=True, name=f"peer{self.host}").start()

    def _linkable(self) -> bool:
        """Whether the call may go on a link: a cold call with its payload inline."""
        return self._spec.keep_warm_seconds == 0 and isinstance(self._payload, bytes) \
            and len(self._payload) <= INLINE_BYTES

    def _start_on(self, link: _peer_link.GatewayLink) -> bool:
        """Start the call on ``link``; False when it cannot take it (the call
        then goes on gRPC, or ends, as ``_relay`` decides)."""
        with self._lock:
            if self._closed.is_set():
                return False
            first = next(call_requests(self._spec, self._payload, "spec"))
            call = link.call(first, self._on_event, self._ended)
            if call is None:
                return False
            self._started(call)
        return True

    def _started(self, call: PeerChannel) -> None:
        """(With ``_lock`` held.) The call is on its way: what was asked
        before it started follows."""
        self._call = call
        early, self._early = self._early, []
        for item in early:
            call.send(item)

    def stacks(self) -> str:
        try:
            reply = stub(self.address, self._credentials).Stacks(
                pb.JobRef(job_id=self._spec.job_id), timeout=5,
                metadata=self._credentials.metadata)
        except grpc.RpcError as exc:
            return f"(the agent at {self.address} did not answer: {exc.details()})"
        return "\n".join(h.text for h in reply.hosts if h.host == self.host) or "(no stacks)"

    def release(self) -> None:
        if not self.parked:
            self._control(pb.RunRequest(control=pb.CONTROL_RELEASE))

    def interrupt(self) -> None:
        if not self.parked:
            self._control(pb.RunRequest(control=pb.CONTROL_INTERRUPT))

    def cancel(self) -> None:
        request = pb.RunRequest(control=pb.CONTROL_CANCEL)
        lane = self._lane
        if lane is not None:          # the quicker way; gRPC too, should the lane be dead
            lane.send(request)
        self._control(request)

    def _control(self, request: pb.RunRequest | str) -> None:
        """Send a request on the call (kept until it has started)."""
        with self._lock:
            call = self._call
            if call is None:
                self._early.append(request)
                return
        call.send(request)

    def next_call(self, spec: pb.JobSpec, payload: bytes | str,
                  emit: Callable[[pb.Event], None]) -> bool:
        """Send a warm session's next call on the open call; False if it is gone."""
        with self._lock:
            if not self.parked or self._closed.is_set():
                return False
            self.parked = False
            self._exited_sent = False
            self._value = None
            self.finished.clear()
            self._emit = emit           # (the call keeps its first job's id: the peer
                                        # knows its worker by it, for stacks)
            lane = self._lane
        requests = call_requests(spec, payload, "next_call")
        if lane is not None and isinstance(payload, bytes) and len(payload) <= INLINE_BYTES:
            with self._lock:
                self._on_lane = True
            if lane.send(next(requests)):       # (one request: the payload inside)
                return True
            with self._lock:
                self._on_lane = False
            requests = call_requests(spec, payload, "next_call")
        for request in requests:
            self._control(request)
        return True

    def abandon(self, detail: str) -> None:
        """The peer did not confirm in time: drop the call, report it lost."""
        self._send_exited(pb.HostReport(host=self.host, state=pb.HOST_STATE_LOST,
                                        detail=detail, finished_at=time.time()))
        self.close()

    def close(self) -> None:
        """The call is over: its RPC ends, unless it is parked (warm)."""
        if not self.parked:
            self.stop()

    def stop(self) -> None:
        """End the RPC (and with it, on the peer, the worker), parked or not."""
        self._close_requests()
        with self._lock:
            call, lane = self._call, self._lane
        if lane is not None:
            lane.close()
        if call is not None:
            call.cancel()

    def _open_lane(self, ticket: pb.DataTicket) -> None:
        """Open the lane the peer offered (in the background: its worker has
        just parked, and the session's next call will use it if it is up)."""
        def connect() -> None:
            mine: list[GatewayLane] = []      # (an earlier lane's end is no news)
            lane = GatewayLane.connect(self.address, ticket, self._relay_event,
                                       lambda why: self._lane_ended(why, mine),
                                       name=f"lane{self.host}",
                                       silence=self._credentials.keepalive or SILENCE_SECONDS)
            if lane is not None:
                mine.append(lane)
                with self._lock:          # (one that ended already said so to nobody)
                    if not self._closed.is_set() and not lane.closed:
                        self._lane, lane = lane, None
            if lane is not None:          # the session ended meanwhile
                lane.close()
        threading.Thread(target=connect, daemon=True, name=f"lane{self.host}-open").start()

    def _lane_ended(self, why: str, mine: list[GatewayLane]) -> None:
        """The lane is gone: between calls, only the lane (the next call goes on
        gRPC, and the peer offers another); while a call sent on it runs, the
        peer is lost (whether the call got there cannot be known): the session ends."""
        with self._lock:
            if not mine or self._lane is not mine[0]:
                return
            self._lane = None
            lost = self._on_lane and bool(why)
        if not why:
            return
        if not lost:
            log.info("peer %d at %s: %s; its calls go on gRPC", self.host, self.address, why)
            return
        if not self._closed.is_set():
            log.warning("peer %d at %s: %s", self.host, self.address, why)
        self._send_exited(pb.HostReport(host=self.host, state=pb.HOST_STATE_LOST,
                                        finished_at=time.time(),
                                        detail=f"agent at {self.address}: {why} during the call"))
        self.stop()

    def pickled_value(self) -> bytes | None:
        """Its function's pickled value, where the call asked for every
        process's (all_results=); None when none came."""
        with self._lock:
            whole = self._value is not None and not self._value_short and \
                len(self._value) == self._value_size
            return bytes(self._value) if whole else None

    def _take_value(self, event: pb.Event) -> None:
        """A result event of all_results=: kept (at most its announced size,
        itself bounded by the worker: OTHER_VALUE_BYTES)."""
        with self._lock:
            if event.HasField("result_size"):
                self._value_short = event.result_size > OTHER_VALUE_BYTES
                self._value = bytearray()
                self._value_size = event.result_size
            elif self._value is not None and not self._value_short:
                self._value += event.result_chunk
                self._value_short = len(self._value) > self._value_size

    def _relay_event(self, event: pb.Event) -> None:
        if event.HasField("result_size") or event.HasField("result_chunk"):
            self._take_value(event)
        elif event.HasField("exited"):
            self._send_exited(event.exited)
        else:
            with self._lock:
                emit = self._emit
            emit(event)

    def _close_requests(self) -> None:
        self._closed.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.close()

    def _relay(self) -> None:
        """Start the call on the link to the peer, or else on gRPC (``run`` here)."""
        if self._linkable() and (link := _peer_link.link_to(self.address, self._credentials)) \
                is not None and self._start_on(link):
            return
        with self._lock:              # stop() cancels the call once it exists
            call = None
            if not self._closed.is_set():
                call = GrpcCall(self.address, self._credentials,
                                call_requests(self._spec, self._payload, "spec"),
                                self._on_event, self._ended)
                self._started(call)
        if call is None:
            self._send_exited(pb.HostReport(
                host=self.host, state=pb.HOST_STATE_LOST, finished_at=time.time(),
                detail="the job ended before this host was started"))
            self._ended(None)
            return
        call.run()

    def _on_event(self, event: pb.Event) -> None:
        if event.HasField("lane"):
            if data_wire.worth_trying(self.address, self._credentials):
                self._open_lane(event.lane)        # (the lane has no TLS)
        else:
            self._relay_event(event)

    def _ended(self, exc: grpc.RpcError | None) -> None:
        """The call is over: how (``exc``, if it failed) is this host's report,
        unless the peer sent its own."""
        if exc is not None:
            forget_if_unavailable(exc, self.address, self._credentials)
            if not self._closed.is_set():
                log.warning("peer %d at %s: %s", self.host, self.address, exc.details())
            detail = f"agent at {self.address} failed: {exc.code().name}: {exc.details()}"
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                detail = f"agent at {self.address}: {error_from_rpc(exc, self.address)}"
            self._send_exited(pb.HostReport(host=self.host, state=pb.HOST_STATE_LOST,
                                            finished_at=time.time(), detail=detail))
        self._close_requests()
        with self._lock:
            self.parked = False          # its peer's worker is gone with the call
            lane = self._lane
        if lane is not None:         # the peer's last events may still be on the lane
            lane.reader.join(timeout=2)
            lane.close()
        self._send_exited(pb.HostReport(
            host=self.host, state=pb.HOST_STATE_LOST, finished_at=time.time(),
            detail=f"agent at {self.address} ended the call without a final report"))

    def _send_exited(self, report: pb.HostReport) -> None:
        with self._lock:
            if self._exited_sent:
                return
            self._exited_sent = True
            self._on_lane = False
            self.parked = report.warm and not self._closed.is_set()
            emit = self._emit
        emit(pb.Event(host=self.host, exited=report))
        self.finished.set()


def preflight_all(remotes: list[RemoteHost]) -> list[tuple[str, bool]]:
    """Every peer's ``preflight``, at once: on the open links, every check is
    sent and then their answers awaited, on this thread; the other peers (and
    any that did not answer) are asked each on a thread of a pool."""
    asked = [remote.ask() for remote in remotes]
    verdicts = [wait() if wait is not None else None for wait in asked]
    rest = [i for i, verdict in enumerate(verdicts) if verdict is None]
    if rest:
        with concurrent.futures.ThreadPoolExecutor(len(rest)) as pool:
            for i, verdict in zip(rest, pool.map(
                    lambda i: remotes[i].preflight(on_link=asked[i] is None), rest)):
                verdicts[i] = verdict
    return verdicts
