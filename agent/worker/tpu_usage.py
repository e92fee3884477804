"""This host's TPU use (duty cycle, HBM) for ``remote-tpu top``, through
Google's ``tpu-info`` library where it is installed and a TPU is present
(libtpu's runtime metrics service, on localhost:8431 while a JAX process
holds the TPU); otherwise a note that says why there are no figures."""

from __future__ import annotations

import glob
import threading
import time

from remote_tpu._core.proto import remote_tpu_pb2 as pb

_EVERY = 2.0             # seconds a reading is reused (one per host, whatever the workers)
_last: tuple[float, pb.TpuUsage] | None = None
_reader: threading.Thread | None = None
_reader_lock = threading.Lock()
_NO_TPU = pb.TpuUsage(note="no TPU on this host")


_HAS_TPU: list[bool] = []       # looked for once


def _has_tpu() -> bool:
    if not _HAS_TPU:
        _HAS_TPU.append(bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")))
    return _HAS_TPU[0]


def _read() -> pb.TpuUsage:
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
    """The newest reading, at once: a thread of its own reads the TPU every
    ``_EVERY`` seconds (libtpu's metrics service may be slow or hang; the
    looks at the workers must not wait for it)."""
    global _reader
    if not _has_tpu():
        return _NO_TPU
    with _reader_lock:
        if _reader is None:
            _reader = threading.Thread(target=_read_forever, daemon=True, name="tpu-usage")
            _reader.start()
    return _last[1] if _last is not None else pb.TpuUsage(note="reading the TPU's metrics")


def _read_forever() -> None:
    global _last
    while True:
        try:
            reading = _read()
        except Exception as exc:  # noqa: BLE001 - said in the note
            reading = pb.TpuUsage(note=f"the TPU's metrics could not be read: {exc}"[:200])
        _last = (time.monotonic(), reading)
        time.sleep(_EVERY)
