"""Bulk bytes on a plain TCP connection (an agent's data port), beside gRPC.

Python gRPC copies each message several times on its way, on each side, and
a slice's agents move a large argument once per host. On a plain socket the
kernel's copy is all (``sendfile`` from a cached file, ``recv_into`` the
destination). Figures: benchmarks/README.md.

An agent without TLS listens on a data port. A transfer is asked for over gRPC
first, where the token is checked; the agent answers with its port, its nonce
and a one-use ticket (``pb.DataTicket``). Then:

1. the sender connects, and the agent greets it with ``MAGIC`` and its nonce:
   a sender that reached something else (a tunnel forwarding only the gRPC
   port to a machine where another program holds that port) sends it nothing;
2. the sender sends the ticket, then exactly the bytes the ticket was asked for;
3. the receiver answers with one length-prefixed protobuf message.

Where the data port cannot be reached, or the channel uses TLS (the data port
has none), the sender uses gRPC as before, and leaves an unreachable port
alone for a while: ``RETRY_AFTER`` seconds, doubling while it keeps failing,
up to ``RETRY_MAX``, and afresh once it works.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from .addresses import host_of
from .channels import ERROR_KIND_KEY
from .limits import CHUNK_SIZE, MAX_MESSAGE_BYTES
from .proto import remote_tpu_pb2 as pb

MAGIC = b"remote-tpu data 1\n"
NONCE_SIZE = 16
TICKET_SIZE = 32
CONNECT_TIMEOUT = 3.0        # a port a firewall drops costs this, once per pause below
IO_TIMEOUT = 120.0           # no byte moved for this long: the other side is gone
MAX_REPLY = 1 << 20
MAX_FRAME = MAX_MESSAGE_BYTES    # a lane's frame body: what a gRPC message may be

HEARTBEAT = 0xFFFFFFFF        # a reply frame of this "length": still working, no reply yet
HEARTBEAT_SECONDS = 1.0

RETRY_AFTER = 30.0           # a data port found unusable is left alone this long,
RETRY_MAX = 600.0            # doubling while it keeps failing, up to this


class Backoff:
    """The one rule for a way beside gRPC (a data port, a gateway's link to a
    peer) that could not be used from here: its address is left alone for a
    pause, ``first`` seconds, twice the last one while it keeps failing, up to
    ``most``, and trusted afresh once it works. Addresses whose pause ended
    long ago are forgotten: the record stays small."""

    def __init__(self, first: float, most: float) -> None:
        self.first = first
        self.most = most
        # address -> (when it is worth trying again, the pause that led there)
        self._paused: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def usable(self, address: str) -> bool:
        with self._lock:
            entry = self._paused.get(address)
            return entry is None or time.monotonic() >= entry[0]

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            for known, (retry_at, _) in list(self._paused.items()):
                if retry_at + self.most < now:
                    del self._paused[known]
            last = self._paused.get(address, (0.0, 0.0))[1]
            pause = min(self.most, 2 * last) if last else self.first
            self._paused[address] = (now + pause, pause)

    def worked(self, address: str) -> None:
        with self._lock:
            self._paused.pop(address, None)


# Agents (by address) whose data port could not be used from here lately.
_unusable = Backoff(RETRY_AFTER, RETRY_MAX)


class Unreachable(Exception):
    """The data port cannot be used: send over gRPC instead. ``lasting``: not
    worth trying again for a while (refused, dropped, someone else's)."""

    def __init__(self, message: str, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


def worth_trying(address: str, credentials) -> bool:
    """Whether to move bulk bytes to or from the agent at ``address`` over its
    data port: not with TLS (the port has none), nor once it proved unusable."""
    return credentials.tls is None and usable(address)


def usable(address: str) -> bool:
    """Whether the data port of the agent at ``address`` is worth asking for:
    not for a while after it could not be reached from this process (each
    ticket asked for in vain would wait there for a minute): ``Backoff``."""
    return _unusable.usable(address)


def connect(address: str, port: int, nonce: bytes, io_timeout: float | None = None
            ) -> socket.socket:
    """A connection to the data port ``port`` of the agent at ``address`` (its
    gRPC address), greeted with ``nonce``; a send or receive that moves nothing
    for ``io_timeout`` seconds (default ``IO_TIMEOUT``) fails."""
    host = host_of(address)
    try:
        sock = _connect(host, port, nonce, io_timeout)
    except Unreachable as exc:
        if exc.lasting:
            _unusable.failed(address)
        raise
    _unusable.worked(address)               # it works (again)
    return sock


def _connect(host: str, port: int, nonce: bytes, io_timeout: float | None) -> socket.socket:
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    except OSError as exc:
        raise Unreachable(f"{host}:{port}: {exc}") from exc
    try:
        greeting = recv_exact(sock, len(MAGIC) + NONCE_SIZE)
    except ConnectionError as exc:     # closed at once: the agent is busy (not remembered)
        sock.close()
        raise Unreachable(f"{host}:{port} is busy: {exc}", lasting=False) from exc
    except OSError as exc:
        sock.close()
        raise Unreachable(f"{host}:{port} did not greet: {exc}") from exc
    if greeting != MAGIC + nonce:
        sock.close()
        raise Unreachable(f"{host}:{port} is not that agent's data port")
    sock.settimeout(io_timeout or IO_TIMEOUT)
    return sock


def open_lane(address: str, ticket: pb.DataTicket) -> socket.socket:
    """A connection that carries frames both ways (a lane, a link): the data
    port of the agent at ``address``, let in by ``ticket``, without Nagle's
    delay. Unreachable, OSError."""
    sock = connect(address, ticket.port, ticket.nonce)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(ticket.ticket)
    except OSError:
        sock.close()
        raise
    return sock


def shut(sock: socket.socket) -> None:
    """Shut both ways: wakes a thread blocked in recv or send on it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def put_blob(stub, address: str, credentials, request: pb.BlobChunk,
             write: Callable[[socket.socket], None]) -> pb.BlobStored | None:
    """Send one buffer to the agent at ``address`` over its data port:
    ``request`` says which (no data), ``write(sock)`` sends its bytes. Its
    reply; None where the data port cannot be used (the caller then sends it
    with PutBlob). gRPC errors of asking for the ticket are raised."""
    if not worth_trying(address, credentials):
        return None
    try:
        ticket = stub.OpenBlob(request, timeout=credentials.answer_within(30),
                               metadata=credentials.metadata)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:     # an older agent
            return None
        raise
    if ticket.refused:
        return pb.BlobStored(refused=ticket.refused)
    if not ticket.port or not ticket.ticket:
        return None
    try:        # (an agent's peers: silent for its --peer-timeout, they are gone)
        sock = connect(address, ticket.port, ticket.nonce, credentials.keepalive)
    except Unreachable:
        return None
    with sock:
        try:
            sock.sendall(ticket.ticket)
            write(sock)
        except OSError as exc:        # it may have refused and said why before closing
            try:
                sock.settimeout(5)
                return pb.BlobStored.FromString(read_reply(sock))
            except OSError:
                raise ConnectionError(f"the data connection to {address} broke: "
                                      f"{exc}") from exc
        try:
            return pb.BlobStored.FromString(read_reply(sock))
        except OSError as exc:       # (TimeoutError: no answer for io_timeout seconds)
            raise ConnectionError(f"the agent at {address} did not confirm the bytes: "
                                  f"{exc}") from exc


def recv_exact(sock: socket.socket, n: int, within: float | None = None) -> bytes:
    """``n`` bytes; with ``within``, all of them within that many seconds."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    deadline = None if within is None else time.monotonic() + within
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes in {within:g} s")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


# Every lane's and link's frame kinds: one numbering, in protos/ (``FrameKind``).
CALL, CANCEL, EVENT, END, ERROR = (pb.FRAME_KIND_CALL, pb.FRAME_KIND_CANCEL, pb.FRAME_KIND_EVENT,
                                   pb.FRAME_KIND_END, pb.FRAME_KIND_ERROR)
REQUEST, HEALTH, HEALTH_REPLY, LINKED = (pb.FRAME_KIND_REQUEST, pb.FRAME_KIND_HEALTH,
                                         pb.FRAME_KIND_HEALTH_REPLY, pb.FRAME_KIND_LINKED)


# What reading a lane's frames may raise when its other end broke it or sent
# what cannot be read (a protobuf DecodeError is no ValueError).
FRAME_ERRORS = (OSError, ValueError, DecodeError)


class LaneError(grpc.RpcError):
    """What a call on a lane was refused with (``ERROR``), or how the
    lane failed it, said as a gRPC error says it."""

    def __init__(self, code: grpc.StatusCode, details: str, kind: str = "") -> None:
        super().__init__(details)
        self._code, self._details, self._kind = code, details, kind

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ((ERROR_KIND_KEY, self._kind),) if self._kind else ()

    def body(self) -> bytes:
        """As a ``ERROR`` frame's body."""
        return json.dumps({"code": self._code.name, "details": self._details,
                           "kind": self._kind}).encode()

    @classmethod
    def from_body(cls, body: bytes) -> LaneError:
        said = json.loads(body)
        return cls(getattr(grpc.StatusCode, said.get("code", ""), grpc.StatusCode.UNKNOWN),
                   said.get("details", ""), said.get("kind", ""))


def keep_alive(sock: socket.socket, seconds: float, bound_unacked: bool = True) -> None:
    """A lane's other end that goes silent (its host gone, the network cut)
    counts as gone after about ``seconds``: TCP keepalive probes while the
    lane is idle, and (``bound_unacked``) a bound on how long what was sent may
    stay unacknowledged (Linux), as gRPC's keepalive does for its calls. That
    bound also ends a connection whose other end is there but reads nothing
    for as long (a zero window), so a sender to a reader that may stall (a
    caller whose output is piped to a slow reader) must do without it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probe = max(1, int(seconds / 3))
    options = [("TCP_KEEPIDLE", probe), ("TCP_KEEPINTVL", probe), ("TCP_KEEPCNT", 2)]
    for name, value in options + ([("TCP_USER_TIMEOUT", int(seconds * 1000))]
                                  if bound_unacked else []):
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass


def send_frame(sock: socket.socket, kind: int, body: bytes = b"") -> None:
    """One frame of a lane or a link (a connection that carries many
    messages, each way: ``frame_connection``): a 4-byte length, one byte of
    kind, the body."""
    sock.sendall((len(body) + 1).to_bytes(4, "big") + bytes((kind,)) + body)


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """A lane's next frame (kind, body); None once the other side has closed
    the connection between frames. A reset raises (ConnectionResetError,
    ConnectionAbortedError): the connection broke, nobody closed it."""
    try:
        head = recv_exact(sock, 4)
    except (ConnectionResetError, ConnectionAbortedError):
        raise
    except ConnectionError:
        return None
    size = int.from_bytes(head, "big")
    if not 1 <= size <= MAX_FRAME + 1:
        raise ConnectionError(f"a lane frame of {size:,} bytes (at most {MAX_FRAME + 1:,})")
    frame = recv_exact(sock, size)
    return frame[0], frame[1:]


def send_reply(sock: socket.socket, message: bytes) -> None:
    sock.sendall(len(message).to_bytes(4, "big") + message)


def read_reply(sock: socket.socket) -> bytes:
    """The receiver's reply, past its heartbeats (each resets the socket's
    timeout: a receiver still at work is not taken for a dead one)."""
    while True:
        size = int.from_bytes(recv_exact(sock, 4), "big")
        if size == HEARTBEAT:
            continue
        if size > MAX_REPLY:
            raise ConnectionError(f"a reply of {size:,} bytes (at most {MAX_REPLY:,} are "
                                  "sent)")
        return recv_exact(sock, size)


class Heartbeat:
    """While a receiver works on what it was sent (storing it, passing it on),
    a heartbeat frame every ``HEARTBEAT_SECONDS`` tells its sender it lives;
    stopped before the reply is sent."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="data-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        frame = HEARTBEAT.to_bytes(4, "big")
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._sock.sendall(frame)
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def byte_view(view: memoryview) -> memoryview:
    """``view`` as a flat view of bytes (an array's buffer may have another shape)."""
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def fill(sock: socket.socket, view: memoryview) -> int:
    """Receive into ``view`` until it is full or the sender closes; how many
    bytes came."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            break
        got += k
    return got


def send_view(sock: socket.socket, view: memoryview,
              progress: Callable[[int], None] | None = None) -> None:
    """Send ``view``'s bytes, from its own memory (no copy here)."""
    view = byte_view(view)
    for start in range(0, view.nbytes, CHUNK_SIZE):
        if progress is not None:
            progress(start)
        sock.sendall(view[start:start + CHUNK_SIZE])


class Incoming:
    """The ``size`` bytes a sender sends after its ticket, in pieces of up to
    ``CHUNK_SIZE``: each a fresh buffer (it may be queued on to others), or
    with ``reuse`` views of one buffer, each good until the next is taken."""

    def __init__(self, sock: socket.socket, size: int, reuse: bool = False) -> None:
        self._sock = sock
        self.size = size
        self.received = 0
        self._reuse = reuse

    def __iter__(self) -> Iterator[bytearray | memoryview]:
        shared = memoryview(bytearray(min(CHUNK_SIZE, self.size))) if self._reuse else None
        while self.received < self.size:
            want = min(CHUNK_SIZE, self.size - self.received)
            view = shared[:want] if shared is not None else memoryview(bytearray(want))
            got = fill(self._sock, view)
            self.received += got
            if got < want:
                return                 # the sender went away: the caller sees it short
            yield view if shared is not None else view.obj

    def drain(self, limit: float = 30.0) -> None:
        """Read and drop what the sender still sends (after a refusal), so that
        it reads the reply instead of a reset; for ``limit`` seconds at most."""
        scratch = bytearray(CHUNK_SIZE)
        self._sock.settimeout(limit)
        deadline = time.monotonic() + limit
        try:
            while self.received < self.size and time.monotonic() < deadline:
                k = self._sock.recv_into(scratch, min(CHUNK_SIZE, self.size - self.received))
                if not k:
                    return
                self.received += k
        except OSError:
            return
