"""``remote-tpu top [JOB]``: one line per process of a running job, refreshed:
state, step and steps per second (``remote_tpu.progress(step=)``), CPU, memory,
output rate and the host's TPU use, with a line for the whole job (the lowest
step and its host: the slowest). From the gateway's Status (``metrics``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence

from ._core.proto import remote_tpu_pb2 as pb
from ._core.states import phase_name

_CLEAR = "\x1b[H\x1b[2J"


def metrics_dicts(metrics: Iterable[pb.HostMetrics]) -> list[dict]:
    """The metrics as plain dicts (``handle.metrics()``, ``--json``)."""
    return [{"host": m.host, "state": m.state, "step": m.step if m.has_step else None,
             "steps_per_second": m.steps_per_second, "cpu_percent": m.cpu_percent,
             "rss_bytes": m.rss_bytes, "output_bytes_per_second": m.output_bytes_per_second,
             "tpu": {"duty_cycle_percent": m.tpu.duty_cycle_percent,
                     "hbm_used_bytes": m.tpu.hbm_used_bytes,
                     "hbm_total_bytes": m.tpu.hbm_total_bytes, "note": m.tpu.note},
             "updated_at": m.updated_at} for m in metrics]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _tpu(t: pb.TpuUsage) -> str:
    if t.note:
        return t.note
    if not t.hbm_total_bytes and not t.duty_cycle_percent:
        return "-"
    return (f"{t.duty_cycle_percent:.0f}% busy, HBM {_size(t.hbm_used_bytes)} of "
            f"{_size(t.hbm_total_bytes)}")


def summary(metrics: Sequence[pb.HostMetrics]) -> str:
    """The whole job in a line: the lowest step (its host: the slowest), the
    steps per second; "" where no host reports steps."""
    stepping = [m for m in metrics if m.has_step and m.state == "running"]
    if not stepping:
        return ""
    slowest = min(stepping, key=lambda m: (m.step, m.host))
    rate = min(m.steps_per_second for m in stepping)
    return (f"step {slowest.step}, {rate:.1f} steps/s"
            + (f", slowest host {slowest.host}" if len(stepping) > 1 else ""))


def table(status: pb.JobStatus) -> str:
    """One screen: the job, then a line per process."""
    head = (f"job {status.job_id} ({status.accelerator}, {status.num_hosts} hosts): "
            f"{phase_name(status.phase)}  {time.strftime('%H:%M:%S')}")
    lines = [head]
    if not status.metrics:
        lines.append("(no metrics: the job is not running)" if status.phase !=
                     pb.JOB_PHASE_RUNNING else "(no metrics yet)")
        return "\n".join(lines) + "\n"
    if line := summary(status.metrics):
        lines.append(line)
    rows = [("HOST", "STATE", "STEP", "STEPS/S", "CPU%", "RSS", "OUTPUT/S", "TPU")]
    for m in status.metrics:
        rows.append((str(m.host), m.state, str(m.step) if m.has_step else "-",
                     f"{m.steps_per_second:.1f}" if m.has_step else "-",
                     f"{m.cpu_percent:.0f}", _size(m.rss_bytes) if m.rss_bytes else "-",
                     f"{_size(m.output_bytes_per_second)}/s", _tpu(m.tpu)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(lines) + "\n"


def top(handle, as_json: bool, once: bool, interval: float) -> int:
    """Print the job's metrics: once (``as_json``, ``once``, or not a
    terminal), or refreshed every ``interval`` seconds until it ends."""
    if as_json:
        print(json.dumps(metrics_dicts(handle._status_reply().metrics), indent=2))
        return 0
    live = sys.stdout.isatty() and not once
    while True:
        status = handle._status_reply()
        sys.stdout.write((_CLEAR if live else "") + table(status))
        sys.stdout.flush()
        if not live or status.phase not in (pb.JOB_PHASE_QUEUED, pb.JOB_PHASE_RUNNING):
            return 0
        time.sleep(interval)
