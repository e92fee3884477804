"""Channels to agents (plaintext or TLS, with the slice token on every call),
and gRPC status -> exception. Used by the client and by gateways for their peers.

A channel without TLS to an address beyond this machine warns once per address
and process; ``REMOTE_TPU_REQUIRE_TLS=1`` refuses it instead."""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings

import grpc

from .addresses import host_of, is_loopback
from .auth import TOKEN_METADATA_KEY, TLS, client_token
from .exceptions import (AgentUnavailableError, AuthenticationError, ConfigurationError,
                          RemoteTPUError, SerializationError, VersionMismatchError)
from .proto import remote_tpu_pb2 as pb
from .proto import remote_tpu_pb2_grpc as pb_grpc
from .tls_probe import turned_away

# Trailing metadata key an agent sets on a refused call: what kind of error it is.
ERROR_KIND_KEY = "remote-tpu-error"
class BlobsMissing(RemoteTPUError):
    """The gateway lacks some of the call's large buffers (evicted since they
    were sent): the client sends the call again with them inside."""


_KINDS: dict[str, type[RemoteTPUError]] = {
    "version": VersionMismatchError,
    "config": ConfigurationError,
    "integrity": SerializationError,
    "blobs-missing": BlobsMissing,
}
MAX_MESSAGE_BYTES = 4 * 1024 * 1024    # our messages are <= 1 MiB chunks plus a header
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE,)
REQUIRE_TLS_ENV = "REMOTE_TPU_REQUIRE_TLS"
_warned_plaintext: set[str] = set()     # addresses already warned about, in this process
_warned_lock = threading.Lock()


class Redirect(RemoteTPUError):
    """The agent asked is not the slice's gateway; ``address`` is. Followed by
    the client, never shown to users unless following fails."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(message)
        self.address = address


def channel_options(overrides: dict[str, int | str] | None = None) -> list[tuple[str, int | str]]:
    """gRPC options for our channels and servers; ``overrides`` replace defaults
    (gRPC would silently keep the first of two equal keys)."""
    options: dict[str, int | str] = {
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
        "grpc.keepalive_time_ms": 10_000,
        "grpc.keepalive_timeout_ms": 5_000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
        # Reconnect soon after an agent restarts (gRPC's own backoff reaches 15 s
        # and more); the client retries refused connects for 15 s.
        "grpc.initial_reconnect_backoff_ms": 250,
        "grpc.max_reconnect_backoff_ms": 2000,
        # A channel's connections are its own: a new channel to an agent that
        # has just restarted connects at once, instead of sharing the failed
        # connection (and its backoff) of a channel that was dropped (``forget``).
        "grpc.use_local_subchannel_pool": 1,
    }
    options.update(overrides or {})
    return list(options.items())


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What a caller presents to an agent: the slice token, and TLS settings."""

    token: str | None = None
    tls: TLS | None = None
    keepalive: float | None = None    # seconds of silence before the peer counts as gone

    @classmethod
    def for_client(cls, token: str | None = None, tls: TLS | None = None) -> Credentials:
        """A client's credentials: ``token`` or the one found by ``client_token``,
        ``tls`` or the ``REMOTE_TPU_TLS_*`` environment."""
        return cls(token=client_token(token), tls=tls if tls is not None else TLS.from_env())

    def answer_within(self, seconds: float) -> float:
        """A deadline for a short request (a question, a ticket): ``seconds``,
        but no more than the silence after which the other end counts as gone
        (an agent's peers: its --peer-timeout), so that a hung peer is named
        within it, not after a minute."""
        return min(seconds, self.keepalive) if self.keepalive else seconds

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self.token),) if self.token else ()

    def channel(self, address: str) -> grpc.Channel:
        overrides: dict[str, int | str] = {}
        if self.keepalive:
            half = max(500, int(self.keepalive * 500))
            overrides = {"grpc.keepalive_time_ms": half, "grpc.keepalive_timeout_ms": half}
        if self.tls is not None and self.tls.server_name:
            overrides["grpc.ssl_target_name_override"] = self.tls.server_name
        options = channel_options(overrides)
        if self.tls is None:
            check_plaintext(address)
            return grpc.insecure_channel(address, options=options)
        ca, key, cert = self.tls.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                             certificate_chain=cert)
        return grpc.secure_channel(address, creds, options=options)


def _require_tls() -> bool:
    value = os.environ.get(REQUIRE_TLS_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ConfigurationError(
        f"${REQUIRE_TLS_ENV}={value!r} is not understood: set it to 1 to refuse connections "
        "without TLS to other machines, or to 0 (or unset it) to allow them with a warning")


def _exposure(address: str) -> str:
    return (f"the connection to the agent at {address} has no TLS: the slice token, the "
            "pickled function and its arguments, and the results would cross the network in "
            "clear, for anyone who can watch it to read (and the token lets them run code on "
            "the slice). Use TLS: tls=remote_tpu.TLS(ca=...) or $REMOTE_TPU_TLS_CA (agents: "
            "--tls-cert/--tls-key/--tls-ca), or reach the agent through an SSH tunnel to "
            "127.0.0.1")


def check_plaintext(address: str) -> None:
    """Before a channel without TLS to ``address``: nothing on loopback; beyond
    this machine a warning, once per address in this process, or a
    ConfigurationError when ``$REMOTE_TPU_REQUIRE_TLS`` is set. Host names other
    than localhost count as beyond this machine."""
    if is_loopback(host_of(address)):
        return
    if _require_tls():
        raise ConfigurationError(f"refusing to connect without TLS (${REQUIRE_TLS_ENV}=1): "
                                 f"{_exposure(address)}.")
    with _warned_lock:
        if address in _warned_plaintext:
            return
        _warned_plaintext.add(address)
    warnings.warn(f"{_exposure(address)}. ${REQUIRE_TLS_ENV}=1 refuses such connections.",
                  UserWarning, stacklevel=3)


_channels: dict[tuple[str, Credentials], grpc.Channel] = {}
_stubs: dict[tuple[str, Credentials], tuple[grpc.Channel, pb_grpc.AgentStub]] = {}
_channels_lock = threading.Lock()


def _channel_key(address: str, credentials: Credentials) -> tuple[str, Credentials]:
    return address, dataclasses.replace(credentials, token=None)


def shared_channel(address: str, credentials: Credentials) -> grpc.Channel:
    """One long-lived channel per agent and TLS setting, for this process (the
    token travels per call, so it is not part of the key). A call that finds
    no agent there should ``forget`` it: the next call then connects afresh at
    once, instead of waiting out the old channel's reconnect backoff (an agent
    that has just restarted is reached by the very next call)."""
    key = _channel_key(address, credentials)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            channel = _channels[key] = credentials.channel(address)
        return channel


def forget(address: str, credentials: Credentials) -> None:
    """Drop the shared channel to ``address`` (calls still on it go on)."""
    with _channels_lock:
        _channels.pop(_channel_key(address, credentials), None)
        _stubs.pop(_channel_key(address, credentials), None)


def forget_if_unavailable(exc: BaseException, address: str, credentials: Credentials) -> None:
    """After a failed call: a channel that found no agent is not kept."""
    if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
        forget(address, credentials)


_TLS_WORDS = ("ssl", "handshake", "certificate", "tsi_")


def tls_failure(details: str) -> bool:
    """Whether gRPC's ``details`` of a failed connection tell of TLS (which
    asking again would not mend)."""
    details = details.lower()
    return any(word in details for word in _TLS_WORDS)


def error_from_rpc(exc: grpc.RpcError, address: str) -> RemoteTPUError:
    """The exception a failed call to the agent at ``address`` becomes."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    kind = ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_KIND_KEY:
            kind = value
    if kind.startswith("redirect "):
        return Redirect(kind.removeprefix("redirect "), details)
    if kind in _KINDS:
        return _KINDS[kind](details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(
            f"the agent at {address} refused this client's credentials ({details}). "
            "Supply the slice's token: token=..., $REMOTE_TPU_TOKEN, $REMOTE_TPU_TOKEN_FILE, "
            "or the file ~/.config/remote_tpu/token (made on an agent host by "
            "`remote-tpu-agent token init`; copy it here with mode 0600).")
    if code == grpc.StatusCode.UNAVAILABLE and tls_failure(details):
        return AgentUnavailableError(
            f"the TLS handshake with the agent at {address} failed ({details}). Check that "
            "tls=remote_tpu.TLS(ca=...) (or $REMOTE_TPU_TLS_CA) names the CA that signed the "
            "agent's certificate, and, when the address dialed is not the name in that "
            "certificate (an SSH tunnel to localhost, say), server_name= that name.")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return AgentUnavailableError(
            f"no remote_tpu agent answered at {address} ({code.name}: {details}). "
            "Check that `remote-tpu-agent` is running there and that this address and "
            "port reach it (for a slice behind a private network, an SSH tunnel to "
            "worker 0 is enough); if the agent uses TLS, pass tls=remote_tpu.TLS(ca=...) "
            "with the CA that signed its certificate. hosts='local' runs a simulated "
            "slice on this machine.")
    if code == grpc.StatusCode.NOT_FOUND:           # a job id the agent does not know
        return RemoteTPUError(f"{details}. Check the job id and hosts=.")
    if code == grpc.StatusCode.CANCELLED:
        return AgentUnavailableError(f"the call to the agent at {address} was cancelled: "
                                     f"{details}")
    name = code.name if code is not None else "error"
    return RemoteTPUError(f"the agent at {address} refused the call ({name}): {details}")


def stub(address: str, credentials: Credentials) -> pb_grpc.AgentStub:
    """The one way to call an agent: a stub on this process's shared channel to
    ``address`` (the call's metadata still carries ``credentials.metadata``).
    Made once per channel (a stub costs ~0.3 ms: one callable per method)."""
    channel = shared_channel(address, credentials)
    key = _channel_key(address, credentials)
    with _channels_lock:
        made = _stubs.get(key)
        if made is not None and made[0] is channel:
            return made[1]
    agent = pb_grpc.AgentStub(channel)
    with _channels_lock:
        _stubs[key] = (channel, agent)
    return agent


def health(address: str, credentials: Credentials, *, attempts: int = 3,
           timeout: float = 5, shared: bool = True) -> pb.HealthReply:
    """Ask the agent for its versions, retrying only on transient faults.
    ``shared=False``: on a channel of its own, closed after (for addresses
    asked once, which the shared cache should not keep)."""
    deadline = credentials.answer_within(timeout)

    def ask() -> pb.HealthReply:
        if not shared:
            with credentials.channel(address) as channel:
                return pb_grpc.AgentStub(channel).Health(
                    pb.HealthRequest(), timeout=deadline, metadata=credentials.metadata)
        try:
            return stub(address, credentials).Health(
                pb.HealthRequest(), timeout=deadline, metadata=credentials.metadata)
        except grpc.RpcError as exc:
            forget_if_unavailable(exc, address, credentials)
            raise

    import tenacity          # (here: an agent that asks no health never imports it)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=0.2, max=2),
        retry=tenacity.retry_if_exception(
            lambda e: isinstance(e, grpc.RpcError) and e.code() in _TRANSIENT),
        reraise=True,
    )
    try:
        return retrying(ask)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:       # (see tls_probe)
            refused = turned_away(address, credentials.tls, exc.details() or "")
            if refused is not None:
                raise refused from None
        raise error_from_rpc(exc, address) from None
