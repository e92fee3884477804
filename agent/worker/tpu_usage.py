"""This host's TPU use (duty cycle, HBM) for ``remote-tpu top``, through
Google's ``tpu-info`` library where it is installed and a TPU is present
(libtpu's runtime metrics service, on localhost:8431 while a JAX process
holds the TPU); otherwise a note that says why there are no figures."""

from __future__ import annotations

import glob
import time

from remote_tpu._core.proto import remote_tpu_pb2 as pb

_EVERY = 2.0             # seconds a reading is reused (one per host, whatever the workers)
_last: tuple[float, pb.TpuUsage] | None = None


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _read() -> pb.TpuUsage:
    if not _has_tpu():
        return pb.TpuUsage(note="no TPU on this host")
    try:
        from tpu_info import device, metrics
    except ImportError:
        return pb.TpuUsage(note="tpu-info is not installed on this host (pip install tpu-info)")
    try:
        chip_type, _count = device.get_local_chips()
        usages = metrics.get_chip_usage(chip_type)
    except Exception as exc:  # noqa: BLE001 - any failure of the metrics service
        return pb.TpuUsage(note=f"tpu-info could not read libtpu's metrics: {exc}"[:200])
    if not usages:
        return pb.TpuUsage(note="libtpu reported no chips")
    return pb.TpuUsage(
        duty_cycle_percent=sum(u.duty_cycle_pct for u in usages) / len(usages),
        hbm_used_bytes=sum(u.memory_usage for u in usages),
        hbm_total_bytes=sum(u.total_memory for u in usages))


def tpu_usage() -> pb.TpuUsage:
    """The newest reading (at most ``_EVERY`` seconds old)."""
    global _last
    now = time.monotonic()
    if _last is None or now - _last[0] > _EVERY:
        _last = (now, _read())
    return _last[1]
