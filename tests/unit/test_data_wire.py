"""The client's side of the data port (remote_tpu/_core/data_wire.py) against
something that is not an agent's data port. The port itself, with tickets:
tests/agent/test_auth.py; calls over it: tests/slice/test_data_port.py."""

from __future__ import annotations

import os
import socket
import threading

import pytest

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
