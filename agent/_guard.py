"""Every RPC is checked for the slice token before its request is read."""

from __future__ import annotations

import logging

import grpc

from remote_tpu._core.auth import TOKEN_METADATA_KEY, tokens_match

log = logging.getLogger(__name__)

_REFUSAL = ("missing or wrong slice token: this agent only serves callers that send "
            f"the slice's token in the '{TOKEN_METADATA_KEY}' call metadata")


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        received = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                received = value
                break
        if tokens_match(received, self._token):
            return continuation(handler_call_details)
        log.warning("refused %s: %s token", handler_call_details.method,
                    "no" if received is None else "wrong")
        return _refusing_handler(continuation(handler_call_details))


def _refusing_handler(real: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``real`` that refuses without reading."""
    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    def refuse_stream(request_or_iterator, context):
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
