"""Telling an agent that refuses this client's certificate (mutual TLS) from
one that is not there: ``tls_probe`` against TLS servers that accept, refuse
with an alert, or close, and against listeners that are no TLS server at all.
(The real agent's refusals: tests/slice/test_security.py.)"""

from __future__ import annotations

import socket
import ssl
import threading

import pytest

from certs import pki  # noqa: F401 - a fixture
from remote_tpu._core.auth import TLS
from remote_tpu._core.tls_probe import speaks_tls, tls_refusal

pytestmark = pytest.mark.timeout(60)


def _serve(handle) -> str:
    """A listener on loopback whose every connection ``handle(conn)`` serves."""
    listener = socket.create_server(("127.0.0.1", 0))

    def loop():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def _tls_server(pki, *, demand_cert: bool) -> str:
    """A TLS server as an agent is: it sends a first frame to a client it
    accepts; a client it refuses gets OpenSSL's alert. (gRPC's server, which
    closes the connection instead, is the real agent's: tests/slice/test_security.py.)"""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*pki["server"])
    context.set_alpn_protocols(["h2"])
    if demand_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(str(pki["ca"].path))

    def handle(raw):
        with raw:
            try:
                conn = context.wrap_socket(raw, server_side=True)
                conn.sendall(b"\x00\x00\x00\x04")          # (an HTTP/2 SETTINGS frame's start)
                conn.recv(1)
            except OSError:
                pass
    return _serve(handle)


def _tls(pki, client: str | None) -> TLS:
    cert, key = pki[client] if client else (None, None)
    return TLS(ca=str(pki["ca"].path), cert=cert, key=key)


def test_a_server_that_accepts_the_client_is_no_refusal(pki):
    for demand in (False, True):
        address = _tls_server(pki, demand_cert=demand)
        assert tls_refusal(address, _tls(pki, "client")) == ""
    assert tls_refusal(_tls_server(pki, demand_cert=False), _tls(pki, None)) == ""


def test_a_server_that_refuses_the_client_says_why_and_how_to_mend_it(pki):
    address = _tls_server(pki, demand_cert=True)
    why = tls_refusal(address, _tls(pki, None))
    assert "mutual TLS (--mtls)" in why and "sends no certificate" in why, why
    why = tls_refusal(address, _tls(pki, "rogue_client"))
    assert "a certificate it does not accept" in why, why
    assert pki["rogue_client"][0] in why and "cert=..., key=..." in why


def test_what_is_no_tls_server_is_no_refusal(pki):
    """An agent restarting (nothing listens), an SSH tunnel with nothing
    behind it (accepts, closes), a silent or plaintext listener: asking again
    may mend these, so none is reported as a refusal."""
    tls = _tls(pki, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"      # bound, not listening
    assert tls_refusal(nobody, tls) == ""
    assert tls_refusal(_serve(lambda conn: conn.close()), tls) == ""
    held = []
    assert tls_refusal(_serve(held.append), tls) == ""           # silent: 2 s
    assert tls_refusal(_serve(lambda conn: conn.sendall(b"\x00" * 9)), tls) == ""
    assert tls_refusal("not-an-address", tls) == ""


def test_a_tls_server_is_told_from_a_plaintext_one(pki):
    """A client without TLS settings learns that the agent it reached speaks
    TLS (whether or not the server would accept it); a plaintext listener, a
    closing one and nothing at all are no TLS server."""
    assert speaks_tls(_tls_server(pki, demand_cert=False))
    assert speaks_tls(_tls_server(pki, demand_cert=True))
    assert not speaks_tls(_serve(lambda conn: conn.sendall(b"\x00" * 9)))
    assert not speaks_tls(_serve(lambda conn: conn.close()))
