"""The client's side of the data port (remote_tpu/_core/data_wire.py) against
something that is not an agent's data port, and the back-off rule of every
way beside gRPC. The port itself, with tickets:
tests/agent/test_auth.py; calls over it: tests/slice/test_data_port.py."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from conftest import wait_until
from remote_tpu._core import data_wire


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
