"""Sending a cached buffer on: to the agents an upload names, as its chunks
arrive (``_Onward``: a tree, each agent passing it to at most ``FAN_OUT``
others), or from this agent's cache to an agent that lacks it (``ensure_on``).
Over the receiver's data port where it has one, else over gRPC (PutBlob)."""

from __future__ import annotations

import concurrent.futures
import queue
import socket
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from remote_tpu._core import data_wire
from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.limits import CHUNK_SIZE, upload_deadline
from remote_tpu._core.proto import remote_tpu_pb2 as pb

FAN_OUT = 4            # agents each agent passes a buffer on to
_QUEUED_CHUNKS = 16    # per onward agent: a slow one holds back the upload, not memory


class Onward:
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


class _Abandoned(Exception):
    """The upload stopped short (its sender went away)."""


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

    def _datas(self) -> Iterator[bytes]:
        while not self._dead.is_set():     # (an agent that refused early reads no more)
            try:
                data = self._chunks.get(timeout=0.5)
            except queue.Empty:
                continue
            if data is None:
                return
            yield data

    def _requests(self) -> Iterator[pb.BlobChunk]:
        yield pb.BlobChunk(blob=self._ref, forward_to=self._rest)
        for data in self._datas():
            yield pb.BlobChunk(data=data)

    def _write(self, sock: socket.socket) -> None:
        sent = 0
        for data in self._datas():
            sock.sendall(data)
            sent += len(data)
        if sent < self._ref.size:
            raise _Abandoned()

    def _run(self) -> None:
        agent = stub(self.address, self._credentials)
        try:
            self._reply = data_wire.put_blob(
                agent, self.address, self._credentials,
                pb.BlobChunk(blob=self._ref, forward_to=self._rest), self._write)
            if self._reply is None:          # no data port there: gRPC
                self._reply = agent.PutBlob(self._requests(),
                                            metadata=self._credentials.metadata,
                                            timeout=upload_deadline(self._ref.size))
        except _Abandoned:
            self._error = self._error or "the upload was abandoned"
        except grpc.RpcError as exc:
            self._error = self._error or f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # noqa: BLE001 - a bad address, say: reported, not lost
            self._error = self._error or f"{type(exc).__name__}: {exc}"
        finally:
            self._dead.set()

    @property
    def dead(self) -> bool:
        """The call is over (refused, failed or done): it takes no more."""
        return self._dead.is_set()

    def put(self, data: bytes | None) -> None:
        """Queue ``data`` for the agent; one that takes nothing for half its
        peer timeout is given up (reported, the rest of the slice served):
        whoever sends to this agent must not wait so long on it that it takes
        this agent for the one that hangs."""
        stall = (self._credentials.keepalive or 0) / 2
        waited = 0.0
        while not self._dead.is_set():
            try:
                self._chunks.put(data, timeout=0.5)
                return
            except queue.Full:
                waited += 0.5
                if stall and waited >= stall:
                    self._error = self._error or f"it took no bytes for {waited:g} s"
                    self._dead.set()
                    return

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
    try:
        with open(path, "rb") as f:
            reply = data_wire.put_blob(stub(address, credentials), address, credentials,
                                       pb.BlobChunk(blob=ref), lambda sock: sock.sendfile(f))
    except grpc.RpcError as exc:
        return [f"{address}: {exc.code().name}: {exc.details()}"]
    except OSError as exc:
        return [f"{address}: {exc}"]
    if reply is not None:
        return _failures(address, reply)
    send = _Send(address, [], ref, credentials)
    with open(path, "rb") as f:
        while not send.dead and (chunk := f.read(CHUNK_SIZE)):
            send.put(chunk)
    return send.finish()


def ensure_on(addresses: Sequence[str], refs: Sequence[pb.BlobRef],
              path_of: Callable[[bytes], str], credentials: Credentials
              ) -> tuple[dict[str, str], set[str]]:
    """Before a job starts on these agents: each holds every buffer of it
    (those it lacks, evicted or never passed on, are sent from this agent's
    cache, where ``path_of(digest)`` is its file; all agents at once). What
    could not be done, by address; and which of them did not answer at all
    (asking them anything more would only wait again)."""
    if not refs or not addresses:
        return {}, set()

    within = credentials.answer_within(30)
    silent: set[str] = set()

    def one(address: str) -> str:
        try:
            present = stub(address, credentials).HaveBlobs(
                pb.BlobQuery(blobs=refs), timeout=within, metadata=credentials.metadata).present
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                silent.add(address)
                return (f"the agent at {address} did not answer within {within:g} s when "
                        f"asked for the call's buffers ({why}): it hangs, or its host or "
                        "the network to it is down")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                silent.add(address)
                return (f"the agent at {address} could not be reached when asked for the "
                        f"call's buffers ({why}): it is not running, or its host or the "
                        "network to it is down")
            return f"could not ask the agent at {address} for the call's buffers: {why}"
        for ref, there in zip(refs, present):
            if there:
                continue
            failed = send_file(address, ref, path_of(ref.digest), credentials)
            if failed:
                return f"could not receive the call's arguments: {'; '.join(failed)}"
        return ""

    unique = list(dict.fromkeys(addresses))
    with concurrent.futures.ThreadPoolExecutor(len(unique)) as pool:
        problems = dict(zip(unique, pool.map(one, unique)))
    return {address: why for address, why in problems.items() if why}, silent
