"""Which host a failed job names as its root cause: the first to fail on its
own, not the loudest (a host whose peer vanished reports that as its error)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from remote_tpu._core.proto import remote_tpu_pb2 as pb

# Messages a surviving host prints when a *peer* failed first: consequences,
# never the root cause while a host failed on its own.
_SECONDARY = re.compile(
    r"connection closed by peer|connection reset|gloo|coordination service|"
    r"heartbeat|barrier|unavailable|deadline.?exceeded|socket closed|broken pipe",
    re.IGNORECASE)


def _is_secondary(report: pb.HostReport) -> bool:
    if report.state == pb.HOST_STATE_FAILED:
        return bool(_SECONDARY.search(report.exception.message)
                    or _SECONDARY.search(report.exception.type_name))
    if report.state == pb.HOST_STATE_DIED:
        return report.signal == "SIGABRT"   # JAX aborts when its peers vanish
    return False


def root_cause(reports: Sequence[pb.HostReport]) -> int:
    """The root-cause host of these final reports, or -1 when none failed."""
    failed = [r for r in reports if r.state in (
        pb.HOST_STATE_FAILED, pb.HOST_STATE_DIED, pb.HOST_STATE_LOST)]
    if not failed:
        return -1
    failed.sort(key=lambda r: (_is_secondary(r), r.finished_at or float("inf"), r.host))
    return failed[0].host
