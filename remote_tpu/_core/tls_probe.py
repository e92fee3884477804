"""Why an agent's TLS turns this client away, learnt by asking it directly.

An agent that demands client certificates (``--mtls``) and gets none, or one
its CA did not sign, closes the connection right after the TLS handshake; an
agent with TLS closes on a client that speaks plaintext to it. gRPC reports
both only as "Socket closed": the very words of an agent that is restarting,
or of an SSH tunnel with nothing behind it. Retrying would wait out the whole
retry budget and then blame an agent that did answer. One handshake of our
own tells them apart: a gRPC server that accepts a client sends its first
HTTP/2 frame at once; one that refuses it closes (or, other TLS servers, sends
an alert about the certificate); a plaintext server or a tunnel with nothing
behind it never completes the handshake."""

from __future__ import annotations

import socket
import ssl
import time

from .addresses import host_of
from .auth import TLS
from .exceptions import AgentUnavailableError, AuthenticationError, RemoteTPUError

_PROBE_SECONDS = 2.0
_AGAIN_SECONDS = 0.5
_HOW = ("pass tls=remote_tpu.TLS(ca=..., cert=..., key=...) (or set $REMOTE_TPU_TLS_CERT "
        "and $REMOTE_TPU_TLS_KEY) with a client certificate signed by the CA its --tls-ca "
        "names")


def turned_away(address: str, tls: TLS | None, details: str) -> RemoteTPUError | None:
    """What to raise when a connection to the agent at ``address`` ended with
    gRPC's ``details`` and the agent's TLS turned this client away (None when
    it did not, or when ``details`` are not of a connection closed at once)."""
    if "socket closed" not in details.lower():
        return None
    if tls is None:
        if speaks_tls(address):
            return AgentUnavailableError(
                f"the agent at {address} speaks TLS and this client connects without it: "
                "pass tls=remote_tpu.TLS(ca=...) (or set $REMOTE_TPU_TLS_CA) with the CA "
                "that signed the agent's certificate")
        return None
    why = tls_refusal(address, tls)
    if why:
        return AuthenticationError(f"the agent at {address} refused this client's TLS "
                                   f"connection: {why}")
    return None


def tls_refusal(address: str, tls: TLS) -> str:
    """Why the agent at ``address`` refuses this client's certificate ("" if
    it does not, or if no TLS server could be asked there)."""
    context = _context()
    try:
        if tls.cert and tls.key:
            context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ValueError):
        return ""
    for attempt in range(2):      # (twice: not an agent that died as it took us)
        if attempt:
            time.sleep(_AGAIN_SECONDS)
        if _handshake(address, context, tls.server_name) is not False:
            return ""
    unless = ("(unless a TLS proxy stands in front of the agent, and the agent behind it "
              "is down)")
    if not tls.cert:
        return ("it closed the connection right after the TLS handshake, as an agent "
                "with mutual TLS (--mtls) does to a client that sends no certificate "
                f"{unless}: {_HOW}")
    return (f"it closed the connection right after the TLS handshake, as an agent with "
            f"mutual TLS (--mtls) does to a certificate it does not accept ({tls.cert!r}) "
            f"{unless}: {_HOW}")


def speaks_tls(address: str) -> bool:
    """Whether a TLS server (an agent started with --tls-cert) answers at
    ``address``, as a client without TLS settings would not know."""
    return _handshake(address, _context(), None) is not None


def _context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False          # (only this client is in question here:
    context.verify_mode = ssl.CERT_NONE     # gRPC itself checks the agent's certificate)
    context.set_alpn_protocols(["h2"])      # (as gRPC's: a server closes on a client without)
    return context


def _handshake(address: str, context: ssl.SSLContext, server_name: str | None
               ) -> bool | None:
    """True: a TLS server there took us; False: it turned us away after, or
    with an alert about our certificate in, the handshake; None: no TLS
    server answered (nothing there, plaintext, silent, a bad address)."""
    try:
        host, port = host_of(address), int(address.rsplit(":", 1)[1])
        with socket.create_connection((host, port), timeout=_PROBE_SECONDS) as raw, \
                context.wrap_socket(raw, server_hostname=server_name or host) as conn:
            return conn.recv(1) != b""
    except ssl.SSLError as exc:     # an alert (in the handshake, or after it in TLS 1.3)
        reason = exc.reason or ""
        if "ALERT" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):
            return False
        return None
    except (OSError, ValueError, IndexError):
        return None
