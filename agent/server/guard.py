"""Every RPC is checked for the slice token before its request is read; the
calls refused are logged by peer, repeats counted rather than each logged."""

from __future__ import annotations

import collections
import logging
import threading
import urllib.parse
from collections.abc import Callable

import grpc

from remote_tpu._core.addresses import host_of
from remote_tpu._core.auth import TOKEN_METADATA_KEY, tokens_match

log = logging.getLogger(__name__)

REFUSALS_INTERVAL = 60.0     # seconds between two lines about one peer's refused calls
_MAX_PEERS = 1000            # peers counted apart in one interval; the rest together

_REFUSAL = ("missing or wrong slice token: this agent only serves callers that send "
            f"the slice's token in the '{TOKEN_METADATA_KEY}' call metadata")


def _peer_host(peer: str) -> str:
    """``"ipv4:10.0.0.2:5555"``, ``"ipv6:%5B::1%5D:5555"`` -> the host; else as is."""
    kind, _, address = urllib.parse.unquote(peer).partition(":")
    return host_of(address) if kind in ("ipv4", "ipv6") else peer


class Refusals:
    """The calls refused for their token, logged: a peer's first at once,
    naming it; its next ones counted, and said in one line per ``interval``
    with their count (and when the agent stops: ``close``)."""

    def __init__(self, interval: float = REFUSALS_INTERVAL) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        # Peers refused lately: why their calls since the last line were refused.
        self._peers: dict[str, collections.Counter[str]] = {}
        self._timer: threading.Timer | None = None
        self._closed = False

    def note(self, peer: str, method: str, why: str) -> None:
        host = _peer_host(peer)
        with self._lock:
            counts = self._peers.get(host)
            if counts is None and len(self._peers) >= _MAX_PEERS:
                counts = self._peers.setdefault("other peers", collections.Counter())
            if counts is not None:
                counts[why] += 1
                return
            self._peers[host] = collections.Counter()
            if self._timer is None and not self._closed:
                self._timer = threading.Timer(self.interval, self._tick)
                self._timer.daemon = True
                self._timer.start()
        log.warning("refused %s from %s: %s (its next refused calls are counted, said "
                    "once per %g s)", method, host, why, self.interval)

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
            self._say()
            # Peers still refused: their next call is counted too; the others
            # (quiet for a whole interval) are forgotten.
            self._peers = {host: collections.Counter() for host, counts in self._peers.items()
                           if counts}
            if self._peers and not self._closed:
                self._timer = threading.Timer(self.interval, self._tick)
                self._timer.daemon = True
                self._timer.start()

    def _say(self) -> None:
        """(Lock held.) One line per peer whose calls were counted."""
        for host, counts in self._peers.items():
            if counts:
                n = sum(counts.values())
                log.warning("refused %d more call%s from %s in the last %g s or less (%s)",
                            n, "" if n == 1 else "s", host, self.interval,
                            ", ".join(f"{why}: {k}" for why, k in counts.most_common()))

    def close(self) -> None:
        """The agent stops: what was counted is said now."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._say()
            self._peers = {}


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str, refusals: Refusals) -> None:
        self._token = token
        self._refusals = refusals

    def intercept_service(self, continuation, handler_call_details):
        received = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                received = value
                break
        if tokens_match(received, self._token):
            return continuation(handler_call_details)
        why = "no slice token" if received is None else "a wrong slice token"
        return _refusing_handler(continuation(handler_call_details),
                                 lambda peer: self._refusals.note(
                                     peer, handler_call_details.method, why))


def _refusing_handler(real: grpc.RpcMethodHandler | None,
                      note: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``real`` that refuses without reading,
    calling ``note(peer)`` first (only the handler learns who the peer is)."""
    def refuse(request_or_iterator, context):
        note(context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    def refuse_stream(request_or_iterator, context):
        note(context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # pragma: no cover - abort raises

    if real is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if real.request_streaming and real.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if real.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if real.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
