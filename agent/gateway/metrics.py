"""A running job's metrics, process by process (``remote-tpu top``,
``handle.metrics()``): state, the step the function last reported
(``remote_tpu.progress(step=)``) and the rate of steps, the worker's CPU and
memory (from its agent's looks, ``worker.progress``), its output rate, and
its host's TPU where that can be read. Built from the events the gateway's
job loop takes (``saw``, that thread only); ``snapshot`` is read from any
thread (Status, an attached caller's Watch): one lock keeps them apart.
Bounded: a few numbers per process, output counted per second for
``OUTPUT_WINDOW`` seconds."""

from __future__ import annotations

import collections
import threading
import time

from remote_tpu._core.proto import remote_tpu_pb2 as pb

OUTPUT_WINDOW = 10.0      # seconds of output the rate is taken over
MIN_GAP = 0.25            # seconds between two samples a rate is taken from
STALE = 3.0               # seconds without a new step: the step rate shown is 0


class _Host:
    __slots__ = ("metrics", "step_at", "cpu", "cpu_at", "output")

    def __init__(self, host: int) -> None:
        self.metrics = pb.HostMetrics(host=host, state="starting")
        self.step_at = 0.0
        self.cpu = -1.0                # the worker's CPU seconds at its last look
        self.cpu_at = 0.0
        self.output: collections.deque[list] = collections.deque()   # [second, bytes]


class JobMetrics:
    def __init__(self, n: int) -> None:
        self._hosts = [_Host(h) for h in range(n)]
        self._lock = threading.Lock()

    def saw(self, event: object) -> None:
        if not isinstance(event, pb.Event) or event.host >= len(self._hosts):
            return
        kind = event.WhichOneof("kind")
        if kind not in ("started", "output", "progress", "done", "exited"):
            return
        now = time.time()
        with self._lock:
            host = self._hosts[event.host]
            m = host.metrics
            if kind == "started":
                m.state = "running"
            elif kind == "output":
                second = int(now)
                if host.output and host.output[-1][0] == second:
                    host.output[-1][1] += len(event.output.data)
                else:
                    host.output.append([second, len(event.output.data)])
                    while host.output[0][0] < now - OUTPUT_WINDOW:
                        host.output.popleft()
            elif kind == "progress":
                self._progress(host, event.progress, now)
            else:
                report = event.done if kind == "done" else event.exited
                m.state = "done" if report.state == pb.HOST_STATE_SUCCEEDED else \
                    pb.HostState.Name(report.state).removeprefix("HOST_STATE_").lower()
            m.updated_at = now

    @staticmethod
    def _progress(host: _Host, p: pb.Progress, now: float) -> None:
        m = host.metrics
        if m.state == "starting":
            m.state = "running"
        if p.has_step and not (m.has_step and now - host.step_at < MIN_GAP):
            if m.has_step and p.step >= m.step:
                m.steps_per_second = (p.step - m.step) / (now - host.step_at)
            m.has_step, m.step, host.step_at = True, p.step, now
        if p.cpu_seconds and now - host.cpu_at >= MIN_GAP:
            if host.cpu >= 0:
                m.cpu_percent = 100 * max(0.0, p.cpu_seconds - host.cpu) / (now - host.cpu_at)
            host.cpu, host.cpu_at = p.cpu_seconds, now
        if p.rss_bytes:
            m.rss_bytes = p.rss_bytes
        if p.HasField("tpu"):
            m.tpu.CopyFrom(p.tpu)

    def snapshot(self) -> list[pb.HostMetrics]:
        now = time.time()
        out = []
        with self._lock:
            for host in self._hosts:
                m = pb.HostMetrics()
                m.CopyFrom(host.metrics)
                m.output_bytes_per_second = sum(
                    n for second, n in host.output if second >= now - OUTPUT_WINDOW
                ) / OUTPUT_WINDOW
                if m.has_step and now - host.step_at > STALE:
                    m.steps_per_second = 0.0          # no step for a while: not stepping
                out.append(m)
        return out
