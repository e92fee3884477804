"""A running job's metrics, process by process (``remote-tpu top``,
``handle.metrics()``): state, the step the function last reported
(``remote_tpu.progress(step=)``) and the rate of steps, the worker's CPU and
memory (from its agent's looks, ``worker.progress``), its output rate, and
its host's TPU where that can be read. Built from the events the gateway's
job loop takes; nothing is asked of the hosts."""

from __future__ import annotations

import collections
import time

from remote_tpu._core.proto import remote_tpu_pb2 as pb

OUTPUT_WINDOW = 10.0      # seconds of output the rate is taken over


class _Host:
    __slots__ = ("metrics", "step_at", "cpu", "cpu_at", "output")

    def __init__(self, host: int) -> None:
        self.metrics = pb.HostMetrics(host=host, state="starting")
        self.step_at = 0.0
        self.cpu = -1.0                # the worker's CPU seconds at its last look
        self.cpu_at = 0.0
        self.output: collections.deque[tuple[float, int]] = collections.deque()


class JobMetrics:
    def __init__(self, n: int) -> None:
        self._hosts = [_Host(h) for h in range(n)]

    def saw(self, event: object) -> None:
        if not isinstance(event, pb.Event) or event.host >= len(self._hosts):
            return
        kind = event.WhichOneof("kind")
        host, now = self._hosts[event.host], time.time()
        m = host.metrics
        if kind == "started":
            m.state = "running"
        elif kind == "output":
            host.output.append((now, len(event.output.data)))
        elif kind == "progress":
            self._progress(host, event.progress, now)
        elif kind in ("done", "exited"):
            report = event.done if kind == "done" else event.exited
            m.state = "done" if report.state == pb.HOST_STATE_SUCCEEDED else \
                pb.HostState.Name(report.state).removeprefix("HOST_STATE_").lower()
        else:
            return
        m.updated_at = now

    @staticmethod
    def _progress(host: _Host, p: pb.Progress, now: float) -> None:
        m = host.metrics
        if m.state == "starting":
            m.state = "running"
        if p.has_step:
            if m.has_step and now > host.step_at and p.step >= m.step:
                m.steps_per_second = (p.step - m.step) / (now - host.step_at)
            m.has_step, m.step, host.step_at = True, p.step, now
        if p.cpu_seconds:
            if host.cpu >= 0 and now > host.cpu_at:
                m.cpu_percent = 100 * max(0.0, p.cpu_seconds - host.cpu) / (now - host.cpu_at)
            host.cpu, host.cpu_at = p.cpu_seconds, now
        if p.rss_bytes:
            m.rss_bytes = p.rss_bytes
        if p.HasField("tpu"):
            m.tpu.CopyFrom(p.tpu)

    def snapshot(self) -> list[pb.HostMetrics]:
        now = time.time()
        out = []
        for host in self._hosts:
            while host.output and host.output[0][0] < now - OUTPUT_WINDOW:
                host.output.popleft()
            m = pb.HostMetrics()
            m.CopyFrom(host.metrics)
            m.output_bytes_per_second = sum(n for _, n in host.output) / OUTPUT_WINDOW
            out.append(m)
        return out
