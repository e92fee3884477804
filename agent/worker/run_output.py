"""A worker's stdout and stderr on their way to its job (``WorkerOutput``):
read at the file-descriptor level (``output_pipe.Pump``: output from C and XLA
too), fed to the tail (the last lines a failure shows), passed through the
noise filter (``output_filter``) and routed on; and what a parked warm worker
prints between calls, held for the next call up to a bound (``HeldOutput``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker.output_filter import NoiseFilter, Tail
from remote_tpu_agent.worker.output_pipe import Pump

Route = Callable[[int, bytes], None]      # (stream, bytes shown) on to the job


class WorkerOutput:
    """One worker's two output pipes; ``route`` takes what they show."""

    def __init__(self, host: int, route: Route) -> None:
        self._host = host
        self._route = route
        self._lock = threading.Lock()     # both pipes feed one tail
        self._tail = Tail()
        self._pumps: list[Pump] = []
        self._noise: dict[int, tuple[NoiseFilter, threading.Lock]] = {}

    def start(self, out_r: int, err_r: int) -> None:
        for stream, fd in ((pb.OUTPUT_STREAM_STDOUT, out_r), (pb.OUTPUT_STREAM_STDERR, err_r)):
            pump = Pump(fd, self._sink(stream), name=f"worker{self._host}-out")
            self._pumps.append(pump)
            pump.start()

    def new_call(self) -> None:
        """A warm worker's next call: its failure shows its own last lines."""
        with self._lock:
            self._tail = Tail()

    def last_lines(self) -> list[str]:
        with self._lock:
            return self._tail.lines()

    def flush(self) -> None:
        """A call is over: everything the worker wrote so far has been routed,
        and what the noise filter held back (a line's start that could still
        have become a Gloo message) belongs to it."""
        for pump in self._pumps:
            pump.drain()
        for stream, (noise, lock) in self._noise.items():
            with lock:
                self._route(stream, noise.flush())

    def await_eof(self, seconds: float) -> bool:
        """After the process group is gone, its pipes end; a process that left
        the group (setsid) may still hold them: stop reading them after
        ``seconds``. Whether one did."""
        deadline = time.monotonic() + seconds
        held = [pump for pump in self._pumps
                if not pump.eof.wait(max(0.0, deadline - time.monotonic()))]
        for pump in held:
            pump.stop()
        return bool(held)

    def _sink(self, stream: int) -> Callable[[bytes], None]:
        """What one pipe's bytes go through: the tail, the noise filter, then
        ``route`` (flushed when the pipe ends)."""
        noise, lock = NoiseFilter(), threading.Lock()
        self._noise[stream] = (noise, lock)

        def deliver(data: bytes) -> None:
            if data:
                with self._lock:
                    self._tail.feed(data)
            with lock:
                self._route(stream, noise.feed(data) if data else noise.flush())
        return deliver


class HeldOutput:
    """What a parked warm worker prints between calls (a thread of the
    user's), kept for the next call up to ``limit`` bytes; beyond it is
    counted, and said when it is taken. Not thread-safe: its owner locks."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held: list[tuple[int, bytes]] = []
        self._size = 0
        self._dropped = 0

    def add(self, stream: int, data: bytes) -> None:
        if self._size + len(data) <= self._limit:
            self._held.append((stream, data))
            self._size += len(data)
        else:
            self._dropped += len(data)

    def take(self) -> list[tuple[int, bytes]]:
        """What was held, with a note of what was dropped past the limit."""
        held, dropped = self._held, self._dropped
        self._held, self._size, self._dropped = [], 0, 0
        if dropped:
            held.append((pb.OUTPUT_STREAM_STDERR, (
                f"\n[remote_tpu: {dropped:,} bytes the warm worker printed between calls "
                f"were dropped; the first {self._limit >> 20} MiB is above]\n").encode()))
        return held
