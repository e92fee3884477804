"""A job's story, host by host (``remote-tpu jobs show``): when each process's
worker started, when ``jax.distributed`` was up, its first output and its end,
as the gateway saw them (its clock: one for every host). Kept in the job's
final report (``JobEnd.timeline``), so a finished job, attached or not, today
or yesterday, tells the same story from its record."""

from __future__ import annotations

import time

from remote_tpu._core.proto import remote_tpu_pb2 as pb


class Timeline:
    def __init__(self, n: int) -> None:
        self._times = [pb.HostTimes(host=h) for h in range(n)]

    def saw(self, event: object) -> None:
        """A host's event, as the gateway's job loop takes it."""
        if not isinstance(event, pb.Event) or event.host >= len(self._times):
            return
        kind = event.WhichOneof("kind")
        times, now = self._times[event.host], time.time()
        if kind == "started" and not times.worker_started_at:
            times.worker_started_at = now
        elif kind == "progress" and event.progress.jax_ready and not times.jax_ready_at:
            times.jax_ready_at = now
        elif kind == "output" and not times.first_output_at:
            times.first_output_at = now
        elif kind in ("done", "exited") and not times.ended_at:
            times.ended_at = now

    def fill(self, end: pb.JobEnd) -> None:
        """Into the job's final report; a host whose end the loop did not see
        (stopped as the job ended) ended when its report says, or now."""
        now = time.time()
        reports = {r.host: r for r in end.hosts}
        for times in self._times:
            if not times.ended_at:
                report = reports.get(times.host)
                times.ended_at = report.finished_at if report and report.finished_at else now
        end.timeline.extend(self._times)
