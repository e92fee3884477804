"""A finished job's story (remote-tpu jobs show): the timeline of a failed, a
retried and a cancelled job, from the job's record, on two real agents."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, on_agents, wait_until
from remote_tpu._retries import Retries
from remote_tpu._story import story

pytestmark = pytest.mark.timeout(180)


def _lines(text: str) -> list[str]:
    """The events of a story, without their times."""
    return [line.split(" s  ", 1)[1] for line in text.splitlines() if " s  " in line]


def _in_order(events: list[str], *wanted: str) -> None:
    """Each of ``wanted`` starts an event, in this order."""
    at = [next((i for i, e in enumerate(events) if e.startswith(w)), -1) for w in wanted]
    assert -1 not in at and at == sorted(at), "\n".join(events)


def _fails_on_host_1():
    import os

    import jax
    from jax.experimental import multihost_utils
    print(f"host {jax.process_index()} here", flush=True)
    if os.environ["REMOTE_TPU_HOST_INDEX"] == "1":
        raise ValueError("host 1 broke")
    multihost_utils.sync_global_devices("waits for host 1")


def test_a_failed_jobs_story_names_the_first_failure_in_time_order(agents):
    fn = on_agents(agents, "tpu-v4-16")(_fails_on_host_1)
    with pytest.raises(ValueError):
        fn()
    shown = subprocess.run([sys.executable, "-m", "remote_tpu", "jobs", "show", fn.last_job.id,
                            "--hosts", agents.addresses[0]], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env={**os.environ, "REMOTE_TPU_TOKEN":
                                                      agents.token})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"job {fn.last_job.id} (tpu-v4-16, 2 hosts): FAILED")
    events = _lines(shown.stdout)
    for h in (0, 1):
        # (Times are when the gateway heard of each: "initialized" comes on the
        # worker's status pipe, output on its stdout, and a loaded machine can
        # deliver the print first; only each one's place after the start holds.)
        _in_order(events, "queued", "running", f"host {h}: worker started",
                  f"host {h}: jax.distributed initialized")
        _in_order(events, f"host {h}: worker started", f"host {h}: first output")
    _in_order(events, "host 1: first output",
              "host 1: failed (the first failure: the root cause)", "ended FAILED")
    assert any(e.startswith("host 0: cancelled") for e in events), events
    failed = next(e for e in events if e.startswith("host 1: failed"))
    assert re.search(r"the root cause\) after \d+\.\d{3} s: ", failed), failed
    assert "queued for" in shown.stdout and "ran for" in shown.stdout


def test_a_retried_jobs_story_tells_each_attempt(agents):
    def fails_once():
        import os
        if os.environ["REMOTE_TPU_ATTEMPT"] == "0" and os.environ["REMOTE_TPU_HOST_INDEX"] == "1":
            raise RuntimeError("attempt 0 broke")
        return "ok"
    handle = on_agents(agents, "tpu-v4-16", retries=Retries(failures=1, backoff=0))(
        fails_once).submit()
    assert handle.result() == "ok"
    events = _lines(story(handle._status_reply()))
    _in_order(events, "queued", "attempt 0 started",
              "attempt 0 ended FAILED on host 1, tried again (failure): host 1 raised",
              "running (attempt 1)", "host 0: worker started", "host 1: succeeded",
              "ended SUCCEEDED")


def test_a_cancelled_jobs_story_ends_cancelled(agents):
    def sleeps():
        import time
        print("asleep", flush=True)
        time.sleep(300)
    handle = on_agents(agents, "tpu-v4-16")(sleeps).submit()
    assert wait_until(lambda: "asleep" in handle.logs(), timeout=60)
    assert "(still going" in story(handle._status_reply())
    handle.cancel()
    handle.wait(30)
    events = _lines(story(handle._status_reply()))
    _in_order(events, "queued", "running", "host 0: first output", "host 0: cancelled",
              "ended CANCELLED")
    assert not any("root cause" in e for e in events), events
