"""`remote-tpu jobs list`: what each job's row says, from the agent's reply
as it comes over the wire. Fast, no agents."""

from __future__ import annotations

import pytest

from remote_tpu._cli_jobs import job_detail
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._jobs import JobStatus

pytestmark = pytest.mark.timeout(30)


def _listed(**fields) -> JobStatus:
    return JobStatus.from_pb(pb.JobStatus(job_id="job-b", accelerator="tpu-v4-16",
                                          num_hosts=2, **fields))


@pytest.mark.parametrize("fields, shown", [
    # Next in line, nothing ahead of it (the slice not yet taken, or warm workers ending).
    (dict(queue_position=1), "next in line (position 1)"),
    (dict(queue_position=2, queued_behind="job-a"), "behind job-a (position 2)"),
    (dict(queued_behind="job-a"), "behind job-a"),
])
def test_a_queued_job_says_where_it_stands(fields, shown):
    detail = job_detail(_listed(phase=pb.JOB_PHASE_QUEUED, **fields))
    assert detail == shown
    assert "None" not in detail


def test_other_jobs_show_their_detail():
    assert job_detail(_listed(phase=pb.JOB_PHASE_FAILED, detail="host 1: ValueError")) == \
        "host 1: ValueError"


def test_since_takes_a_duration_ago_or_a_local_time():
    import argparse
    import datetime

    from remote_tpu._cli_jobs import since_time

    now = datetime.datetime(2026, 11, 27, 14, 30, 0).timestamp()
    assert since_time("90s", now) == now - 90
    assert since_time("10m", now) == now - 600
    assert since_time("1.5h", now) == now - 5400
    assert since_time("1d", now) == now - 86400
    assert since_time("14:05", now) == datetime.datetime(2026, 11, 27, 14, 5).timestamp()
    assert since_time("2026-11-26 23:59:30", now) == \
        datetime.datetime(2026, 11, 26, 23, 59, 30).timestamp()
    for bad in ("", "soon", "10x", "-5m", "25:99"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a time: give a duration"):
            since_time(bad, now)
