"""The client's channel to its gateway, and gRPC status -> exception."""

from __future__ import annotations

import grpc
import tenacity

from ._exceptions import (AgentUnavailableError, ConfigurationError, RemoteTPUError,
                          VersionMismatchError)
from ._proto import remote_tpu_pb2 as pb
from ._proto import remote_tpu_pb2_grpc as pb_grpc
from ._version import local_versions

# Trailing metadata key an agent sets on a refused call: what kind of error it is.
ERROR_KIND_KEY = "remote-tpu-error"
_KINDS: dict[str, type[RemoteTPUError]] = {
    "version": VersionMismatchError,
    "config": ConfigurationError,
}
MAX_MESSAGE_BYTES = 8 * 1024 * 1024    # our messages are <= 1 MiB chunks; headroom
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE,)


def versions_pb() -> pb.Versions:
    """This process's versions, as sent on the wire."""
    v = local_versions()
    return pb.Versions(protocol=int(v["protocol"]), remote_tpu=str(v["remote_tpu"]),
                       python=str(v["python"]), cloudpickle=str(v["cloudpickle"]),
                       jax=str(v["jax"]))


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def open_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=channel_options())


def error_from_rpc(exc: grpc.RpcError, address: str) -> RemoteTPUError:
    """The exception a failed call to the agent at ``address`` becomes."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    kind = ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_KIND_KEY:
            kind = value
    if kind in _KINDS:
        return _KINDS[kind](details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return AgentUnavailableError(
            f"no remote_tpu agent answered at {address} ({code.name}: {details}). "
            "Check that `remote-tpu-agent` is running there and that this address and "
            "port reach it (for a slice behind a private network, an SSH tunnel to "
            "worker 0 is enough); hosts='local' runs a simulated slice on this machine.")
    if code == grpc.StatusCode.CANCELLED:
        return AgentUnavailableError(f"the call to the agent at {address} was cancelled: "
                                     f"{details}")
    name = code.name if code is not None else "error"
    return RemoteTPUError(f"the agent at {address} refused the call ({name}): {details}")


def health(address: str, channel: grpc.Channel, *, attempts: int = 3) -> pb.HealthReply:
    """Ask the agent for its versions, retrying only on transient faults."""
    stub = pb_grpc.AgentStub(channel)
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=0.2, max=2),
        retry=tenacity.retry_if_exception(
            lambda e: isinstance(e, grpc.RpcError) and e.code() in _TRANSIENT),
        reraise=True,
    )
    try:
        return retrying(stub.Health, pb.HealthRequest(), timeout=5)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, address) from None
