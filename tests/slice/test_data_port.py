"""The agents' data port: large arguments and values travel on plain TCP
connections, each let in by a one-use ticket from a token-checked call; where
the port cannot be reached, or TLS is on, gRPC carries them, and nothing is
lost either way."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

import remote_tpu
from conftest import Agents, free_port, on_agents, wait_until
from raw_calls import blob_ticket
from remote_tpu._core import data_wire, digests
from remote_tpu._core.channels import Credentials, stub
from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb

pytestmark = pytest.mark.timeout(240)


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


def test_an_agent_turned_off_or_with_tls_has_no_data_port():
    agents = Agents(1, devices=2, peers=False, extra=["--spare-workers", "0",
                                                      "--data-port", "-1"])
    try:
        assert blob_ticket(agents, CHUNK_SIZE).port == 0
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
