"""What Python gRPC itself costs on this machine, measured against nothing of
ours: the floor under a warm call (benchmarks/warm_call.py).

    .venv/bin/python benchmarks/transport_floor.py [--calls 500]

A server process and this process, on loopback, no auth, 1-byte messages:

- a unary call (request, reply);
- a fresh stream-stream call (one request, three replies): what a warm call's
  client -> gateway hop pays (``Run``), and the same as a unary-stream call
  (``RunInline``: a call whose payload fits in its one request);
- one message each way on a stream-stream call that stays open: what each
  gateway -> peer hop of a warm session pays.

Prints wall time and the CPU time of each side per call. A warm call on a
tpu-v4-32 slice makes one fresh call and three open-stream round trips, and
every agent and worker on top is Python: with 2 cores, the sum of these CPU
times bounds how fast it can be.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import time
from concurrent import futures

import grpc
import psutil


def _same(data: bytes) -> bytes:
    return data


def _serve(ports: multiprocessing.Queue) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(8))

    def unary(request, context):
        return b"y"

    def fresh(requests, context):
        next(requests)
        for _ in range(3):
            yield b"y"

    def fresh_unary(request, context):
        for _ in range(3):
            yield b"y"

    def open_stream(requests, context):
        for _ in requests:
            yield b"y"

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
        "Fresh": grpc.stream_stream_rpc_method_handler(fresh, _same, _same),
        "FreshUnary": grpc.unary_stream_rpc_method_handler(fresh_unary, _same, _same),
        "Open": grpc.stream_stream_rpc_method_handler(open_stream, _same, _same),
    }),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=30)}")
    unary = channel.unary_unary("/floor.Floor/Unary", _same, _same)
    fresh = channel.stream_stream("/floor.Floor/Fresh", _same, _same)
    fresh_unary = channel.unary_stream("/floor.Floor/FreshUnary", _same, _same)
    requests: queue.Queue = queue.Queue()
    open_call = channel.stream_stream("/floor.Floor/Open", _same, _same)(
        iter(requests.get, None))

    def round_trip() -> bytes:
        requests.put(b"x")
        return next(open_call)

    me, there = psutil.Process(), psutil.Process(server.pid)
    for name, one in (("unary call", lambda: unary(b"x")),
                      ("fresh stream-stream call, 3 replies", lambda: list(fresh(iter([b"x"])))),
                      ("fresh unary-stream call, 3 replies", lambda: list(fresh_unary(b"x"))),
                      ("round trip on an open stream", round_trip)):
        for _ in range(50):
            one()
        ours, theirs, start = _cpu(me), _cpu(there), time.perf_counter()
        for _ in range(args.calls):
            one()
        n = args.calls
        print(f"{name:38s} wall {(time.perf_counter() - start) / n * 1e3:.2f} ms, CPU: "
              f"caller {(_cpu(me) - ours) / n * 1e3:.2f} ms, server "
              f"{(_cpu(there) - theirs) / n * 1e3:.2f} ms")
    requests.put(None)
    channel.close()
    server.terminate()


if __name__ == "__main__":
    main()
