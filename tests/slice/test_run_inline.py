"""RunInline: a call whose payload fits in its one request goes without a
request stream; a larger one goes with Run; an agent that does not know
RunInline (an older one) is called with Run."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest

from conftest import on_agents
from remote_tpu import _transport
from remote_tpu_agent.jobs.views import VALUE_IN_END_BYTES
from remote_tpu._core.limits import INLINE_BYTES
from remote_tpu._core.proto import remote_tpu_pb2 as pb

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.agents(n=1, peers=False, extra=["--spare-workers", "0"])]

SERVICE = "remote_tpu.v1.Agent"


class _OlderAgent:
    """A real agent behind a gRPC proxy that forwards every method but
    RunInline, as an agent from before RunInline answers: UNIMPLEMENTED."""

    def __init__(self, behind: str) -> None:
        self.channel = grpc.insecure_channel(behind)
        self.calls: list[str] = []
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["Agent"].methods:
            if method.name == "RunInline":
                continue
            handlers[method.name] = self._forward(method)
        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _forward(self, method):
        path = f"/{SERVICE}/{method.name}"
        kind = (method.client_streaming, method.server_streaming)
        same = (None, None)          # raw bytes both ways
        make = {(False, False): (self.channel.unary_unary, grpc.unary_unary_rpc_method_handler),
                (False, True): (self.channel.unary_stream, grpc.unary_stream_rpc_method_handler),
                (True, False): (self.channel.stream_unary, grpc.stream_unary_rpc_method_handler),
                (True, True): (self.channel.stream_stream,
                               grpc.stream_stream_rpc_method_handler)}[kind]
        there = make[0](path, *same)

        def relay(request, context):
            self.calls.append(method.name)
            return there(request, metadata=context.invocation_metadata())
        return make[1](relay, *same)

    def stop(self) -> None:
        self.server.stop(0)
        self.channel.close()


def test_a_small_call_and_a_large_one_both_run(agents):
    call = on_agents(agents, stream="none")(lambda a: int(a.sum()))
    assert call(np.ones(4, np.uint8)) == 4                          # inside its spec
    big = np.ones(INLINE_BYTES + 1, np.uint8)                       # one byte past it
    assert call(big) == INLINE_BYTES + 1


def test_an_agent_without_run_inline_is_called_with_run(agents):
    older = _OlderAgent(agents.addresses[0])
    try:
        _transport.without_run_inline.discard(older.address)
        import remote_tpu
        call = remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=older.address,
                              token=agents.token, stream="none")(lambda: 7)
        assert call() == 7
        assert call() == 7
        assert older.address in _transport.without_run_inline
        assert older.calls.count("Run") == 2      # the first after UNIMPLEMENTED; then at once
    finally:
        older.stop()
        _transport.without_run_inline.discard(older.address)


def _pickled_of_size(size: int) -> bytes:
    """A bytes value whose pickle (as a worker sends it) is exactly ``size`` bytes."""
    from remote_tpu._core import serialization

    overhead = len(serialization.dumps(b"", what="v").to_bytes())
    for k in range(size - overhead - 16, size - overhead + 16):
        if len(serialization.dumps(b"x" * k, what="v").to_bytes()) == size:
            return b"x" * k
    raise AssertionError(f"no bytes value pickles to {size} bytes")


@pytest.mark.parametrize("size", [VALUE_IN_END_BYTES, VALUE_IN_END_BYTES + 1])
def test_a_small_value_comes_inside_the_final_report_a_larger_one_in_chunks(
        agents, size, monkeypatch):
    kinds: list[str] = []
    events = _transport.StartedRun.__iter__

    def watched(self):
        for event in events(self):
            kinds.append(event.WhichOneof("kind"))
            yield event
    monkeypatch.setattr(_transport.StartedRun, "__iter__", watched)
    value = _pickled_of_size(size)
    call = on_agents(agents, stream="none")(lambda v: v)
    assert call(value) == value
    assert kinds[-1] == "end"
    assert ("result_chunk" in kinds) == (size > VALUE_IN_END_BYTES)
    handle = call.submit(value)                  # and through Result, later
    assert handle.result() == value
