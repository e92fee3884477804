"""The agents' data port: large arguments and values travel on plain TCP
connections, each let in by a one-use ticket from a token-checked call; where
the port cannot be reached, or TLS is on, gRPC carries them, and nothing is
lost either way."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import numpy as np
import pytest

import remote_tpu
from conftest import Agents, free_port, on_agents, wait_until
from remote_tpu._core import data_wire, digests
from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fresh_memory(monkeypatch):
    """This process has not yet found any data port unreachable."""
    monkeypatch.setattr(data_wire, "_unusable", data_wire.Backoff(data_wire.RETRY_AFTER,
                                                                 data_wire.RETRY_MAX))


@pytest.fixture
def firewalled(monkeypatch, fresh_memory):
    """Connections to any data port are refused (as a firewall or a tunnel
    that forwards only the gRPC port would); gRPC is untouched."""
    real = socket.create_connection

    def refuse(address, *args, **kwargs):
        raise ConnectionRefusedError(f"refused {address} (a firewall)")
    monkeypatch.setattr(data_wire.socket, "create_connection", refuse)
    yield
    monkeypatch.setattr(data_wire.socket, "create_connection", real)


def _ticket(agents: Agents, size: int, digest: bytes | None = None) -> pb.DataTicket:
    data_ref = pb.BlobRef(digest=digest or os.urandom(digests.SIZE), size=size)
    creds = Credentials(token=agents.token)
    return stub(agents.addresses[0], creds).OpenBlob(
        pb.BlobChunk(blob=data_ref), metadata=creds.metadata, timeout=30)


def _make(agents, **kw):
    @on_agents(agents, accelerator="tpu-v4-16", stream="none", **kw)
    def make(n):
        import numpy as np
        return np.arange(n, dtype=np.uint8) if n else b""
    return make


# The value's size at the edges of the chunk, and of a value that travels inline.
SIZES = [0, 1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE + 7]


@pytest.mark.parametrize("n", SIZES)
def test_values_of_every_size_come_back_whole_over_the_data_port(pair, fresh_memory, n):
    value = _make(pair)(n)
    assert len(value) == n and bytes(value) == bytes(np.arange(n, dtype=np.uint8))


@pytest.mark.parametrize("n", [CHUNK_SIZE + 1, 3 * CHUNK_SIZE + 7])
def test_a_client_that_cannot_reach_the_data_port_gets_everything_over_grpc(pair, firewalled,
                                                                           n):
    array = np.arange(n, dtype=np.uint8)

    @on_agents(pair, accelerator="tpu-v4-16", stream="none")
    def echo(a):
        return a.copy()
    assert bytes(echo(array)) == bytes(array)           # argument and value


def test_values_a_client_cannot_fetch_do_not_pile_up_on_the_gateway(pair, firewalled):
    """The first value's ticket cannot be used: it is read over gRPC, and the
    next calls ask for no ticket; no value waits in the gateway's memory for
    a ticket to lapse."""
    from remote_tpu_agent.host.cache_dir import default_dir

    make = _make(pair)
    for _ in range(3):
        assert len(make(2 * CHUNK_SIZE)) == 2 * CHUNK_SIZE
    assert not data_wire.usable(pair.addresses[0])
    results = os.path.join(default_dir(pair.state_dirs[0]), "results")
    assert wait_until(lambda: not os.listdir(results), timeout=10), os.listdir(results)


def test_a_submitted_jobs_value_over_the_data_port_and_without_it(pair, monkeypatch,
                                                                   fresh_memory):
    n = 2 * CHUNK_SIZE + 3
    handle = _make(pair).submit(n)
    assert bytes(handle.result(timeout=120)) == bytes(np.arange(n, dtype=np.uint8))

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError("a firewall")
    monkeypatch.setattr(data_wire.socket, "create_connection", refuse)
    monkeypatch.setattr(data_wire, "_unusable", data_wire.Backoff(data_wire.RETRY_AFTER,
                                                                 data_wire.RETRY_MAX))
    assert bytes(handle.result(timeout=120)) == bytes(np.arange(n, dtype=np.uint8))


@pytest.mark.slow
def test_a_data_port_found_unusable_is_tried_again_after_a_back_off(pair, fresh_memory,
                                                                   monkeypatch):
    """One connection that failed (a timeout in a busy moment) does not send
    bulk bytes over gRPC for the rest of the process: the data port is tried
    again after a pause, which doubles while it keeps failing, up to a bound,
    and starts afresh once it works."""
    monkeypatch.setattr(data_wire, "_unusable", data_wire.Backoff(1.0, 2.0))
    address = pair.addresses[0]
    creds = Credentials(token=pair.token)

    def send() -> pb.BlobStored | None:
        data = os.urandom(CHUNK_SIZE + 3)
        ref = pb.BlobRef(digest=digests.of(data), size=len(data))
        return data_wire.put_blob(stub(address, creds), address, creds,
                                  pb.BlobChunk(blob=ref), lambda sock: sock.sendall(data))

    def fail_then_wait() -> float:
        """A connection refused (nothing listens there); how long until the
        data port is worth trying again."""
        start = time.monotonic()
        with pytest.raises(data_wire.Unreachable):
            data_wire.connect(address, free_port(), os.urandom(data_wire.NONCE_SIZE))
        assert send() is None                       # meanwhile: gRPC's turn
        assert wait_until(lambda: data_wire.usable(address), timeout=10)
        return time.monotonic() - start

    assert fail_then_wait() >= 1.0
    assert send().refused == ""                     # over the data port again
    assert 1.0 <= fail_then_wait() < 2.0            # (it worked: the pause starts afresh)
    assert fail_then_wait() >= 2.0                  # failed again: twice as long
    assert 2.0 <= fail_then_wait() < 3.5            # and no longer than its most


def test_a_connection_without_a_ticket_is_greeted_and_closed(pair):
    ticket = _ticket(pair, CHUNK_SIZE)
    assert ticket.port and len(ticket.nonce) == data_wire.NONCE_SIZE
    with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as s:
        greeting = data_wire.recv_exact(s, len(data_wire.MAGIC) + data_wire.NONCE_SIZE)
        assert greeting == data_wire.MAGIC + ticket.nonce
        s.sendall(os.urandom(data_wire.TICKET_SIZE) + b"x" * 1000)
        try:
            answer = s.recv(1)
        except ConnectionResetError:               # closed with our bytes unread
            answer = b""
        assert answer == b""                       # closed, nothing answered


def test_a_ticket_lets_in_one_connection_only(pair):
    data = os.urandom(CHUNK_SIZE + 5)
    ticket = _ticket(pair, len(data), digests.of(data))

    def send():
        s = data_wire.connect(pair.addresses[0], ticket.port, ticket.nonce)
        s.sendall(ticket.ticket)
        return s
    with send() as s:
        s.sendall(data)
        assert pb.BlobStored.FromString(data_wire.read_reply(s)).refused == ""
    with send() as s:                              # the same ticket again
        with pytest.raises(ConnectionError):       # closed: a reset, or no reply
            s.sendall(data)
            data_wire.read_reply(s)


def test_a_corrupted_buffer_is_refused_and_the_sender_reads_why(pair):
    data = os.urandom(2 * CHUNK_SIZE)
    ticket = _ticket(pair, len(data), digests.of(b"something else"))
    with data_wire.connect(pair.addresses[0], ticket.port, ticket.nonce) as s:
        s.sendall(ticket.ticket + data)
        stored = pb.BlobStored.FromString(data_wire.read_reply(s))
    assert "does not match its xxh3-128 digest" in stored.refused


def test_tickets_are_only_for_callers_with_the_token(pair):
    with pytest.raises(grpc.RpcError) as err:
        stub(pair.addresses[0], Credentials()).OpenBlob(
            pb.BlobChunk(blob=pb.BlobRef(digest=bytes(16), size=1)), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_something_else_on_the_port_is_sent_nothing(fresh_memory):
    """A port that another program holds (a tunnel to the wrong machine): the
    greeting does not match, and not one byte is sent to it."""
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def impostor():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + bytes(16))
            conn.settimeout(2)
            try:
                received.append(conn.recv(100))
            except OSError:
                received.append(b"")
    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(data_wire.Unreachable, match="not that agent's data port"):
        data_wire.connect(f"127.0.0.1:{server.getsockname()[1]}", server.getsockname()[1],
                          os.urandom(data_wire.NONCE_SIZE))
    server.close()
    assert received in ([b""], [])


def test_an_agent_turned_off_or_with_tls_has_no_data_port():
    agents = Agents(1, devices=2, peers=False, extra=["--spare-workers", "0",
                                                      "--data-port", "-1"])
    try:
        assert _ticket(agents, CHUNK_SIZE).port == 0
        array = np.arange(CHUNK_SIZE + 9, dtype=np.uint8)

        @on_agents(agents, accelerator="tpu-v5litepod-4", stream="none")
        def echo(a):
            return a.copy()
        assert bytes(echo(array)) == bytes(array)
    finally:
        agents.stop()


def test_a_bad_data_port_flag_is_refused():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--port", "0",
                           "--data-port", "70000"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--data-port must be a port" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--port", "45677",
                           "--data-port", "45677"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is the agent's gRPC port" in proc.stderr


@pytest.mark.slow
def test_a_peer_that_hangs_mid_upload_fails_the_call_naming_it(fresh_memory):
    """A stopped peer takes bytes until its buffers fill, then none: the
    gateway gives up on it after --peer-timeout and the call fails naming it,
    as over gRPC (no bare socket timeout reaches the caller)."""
    import signal
    import time

    agents = Agents(2, devices=2, extra=["--spare-workers", "0", "--peer-timeout", "3"])
    try:
        os.kill(agents.procs[1].pid, signal.SIGSTOP)
        array = np.ones(64 * CHUNK_SIZE, dtype=np.uint8)

        @on_agents(agents, accelerator="tpu-v4-16", stream="none")
        def size_of(a):
            return a.nbytes
        start = time.monotonic()
        with pytest.raises(remote_tpu.RemoteTPUError) as err:
            size_of(array)
        assert time.monotonic() - start < 60
        assert agents.addresses[1] in str(err.value)
    finally:
        os.kill(agents.procs[1].pid, signal.SIGCONT)
        agents.stop()


@pytest.mark.slow
def test_a_hung_agent_deep_in_the_forwarding_tree_is_the_one_named(fresh_memory):
    """Six hosts: the gateway passes a buffer to four agents, the first of
    which passes it on to the sixth. When the sixth hangs, its parent keeps
    answering (heartbeats) and gives it up; the call names the sixth, not its
    healthy parent. Each question to it waits at most the peer timeout, and
    it is asked no more once it failed one: the call fails within a few peer
    timeouts (it took 45 s when each waited 30 s and the preflight asked again)."""
    import signal
    import time

    agents = Agents(6, devices=4, extra=["--spare-workers", "0", "--peer-timeout", "4"])
    try:
        os.kill(agents.procs[5].pid, signal.SIGSTOP)
        array = np.ones(64 * CHUNK_SIZE, dtype=np.uint8)

        @on_agents(agents, accelerator="tpu-v4-48", stream="none", init_jax=False)
        def size_of(a):
            return a.nbytes
        start = time.monotonic()
        with pytest.raises(remote_tpu.RemoteTPUError) as err:
            size_of(array)
        assert time.monotonic() - start < 30
        message = str(err.value)
        assert agents.addresses[5] in message
        assert f"{agents.addresses[1]}: " not in message, message
    finally:
        os.kill(agents.procs[5].pid, signal.SIGCONT)
        agents.stop()


@pytest.mark.slow
def test_a_connection_that_dribbles_no_ticket_is_closed(pair):
    """Someone without the token cannot hold the port's connections by sending
    a byte now and then: the ticket must come whole within 10 s."""
    import time

    port = _ticket(pair, CHUNK_SIZE).port
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        data_wire.recv_exact(s, len(data_wire.MAGIC) + data_wire.NONCE_SIZE)
        s.settimeout(2)
        closed = False
        while not closed and time.monotonic() - start < 30:
            try:
                s.sendall(b"x")              # one byte of the ticket every 2 s
                closed = s.recv(1) == b""
            except socket.timeout:
                continue
            except ConnectionError:
                closed = True
    assert closed and time.monotonic() - start < 15


@pytest.mark.timeout(30)
def test_one_back_off_rule_for_every_way_beside_grpc():
    """A data port and a peer's link found unusable follow one rule
    (``data_wire.Backoff``): a first pause, doubling while the way keeps
    failing, up to a most, afresh once it works; other addresses unaffected."""
    from remote_tpu_agent.wire import peer_link
    assert isinstance(data_wire._unusable, data_wire.Backoff)
    assert isinstance(peer_link._unopened, data_wire.Backoff)
    backoff = data_wire.Backoff(0.5, 1.0)

    def paused_for() -> float:
        start = time.monotonic()
        backoff.failed("a:1")
        assert not backoff.usable("a:1") and backoff.usable("b:1")
        assert wait_until(lambda: backoff.usable("a:1"), timeout=5, interval=0.01)
        return time.monotonic() - start

    assert 0.5 <= paused_for() < 0.95
    assert paused_for() >= 1.0                  # failed again: twice as long
    assert 1.0 <= paused_for() < 1.9            # no longer than its most (else 2 s)
    backoff.worked("a:1")
    assert 0.5 <= paused_for() < 0.95           # it worked: afresh
