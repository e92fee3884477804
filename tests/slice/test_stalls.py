"""Stalls named automatically (stall_after=): on four real agents with real
multi-process JAX on CPU, one host blocks in a sleep while the others wait for
it in a collective; nothing moves anywhere, and the report names that host and
its frame."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import remote_tpu
from conftest import ROOT, live_workers, on_agents, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.agents(n=4)]

STALL_AFTER = 3.0


def _one_host_sleeps():
    import time

    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("started")
    print("every host started", flush=True)
    if jax.process_index() == 2:
        time.sleep(600)                # the stuck host
    multihost_utils.sync_global_devices("step")      # the others wait here


def _busy_and_quiet():
    import time

    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("started")
    end, n = time.monotonic() + 3 * 3.0, 0
    while time.monotonic() < end:        # CPU on every host, not a word printed
        n += sum(i * i for i in range(10_000))
    multihost_utils.sync_global_devices("done")
    return n > 0


def _stalls_of(agents, job_id: str) -> list:
    """The job's stall reports (none while the gateway does not know it yet)."""
    try:
        handle = remote_tpu.attach(job_id, agents.addresses[0], token=agents.token)
    except remote_tpu.RemoteTPUError as exc:
        assert "has no job" in str(exc)
        return []
    return list(handle._status_reply().stalls)


def test_the_stuck_host_is_named_with_its_frame_and_the_job_goes_on(agents, capfd):
    fn = on_agents(agents, "tpu-v4-32", stall_after=STALL_AFTER, timeout=60)(_one_host_sleeps)
    errors = []
    caller = threading.Thread(target=lambda: errors.append(_raised(fn)))
    caller.start()
    try:
        assert wait_until(lambda: fn.last_job is not None and
                          _stalls_of(agents, fn.last_job.id), timeout=90)
        stall = _stalls_of(agents, fn.last_job.id)[0]
        assert list(stall.odd_hosts) == [2], stall.text
        assert stall.quiet_seconds < STALL_AFTER + 2, stall.quiet_seconds
        assert "host 2 differs from the other 3 (hosts 0, 1, 3); it is at:" in stall.text
        odd, usual = stall.text.split("where hosts 0, 1, 3 are at:")
        assert "in _one_host_sleeps" in odd.split("it is at:")[1]      # its sleep's line
        assert "in sync_global_devices" in usual and "in _one_host_sleeps" in usual
        assert not stall.cancelled
        time.sleep(STALL_AFTER + 1.5)          # still quiet: reported once per quiet spell
        assert len(_stalls_of(agents, fn.last_job.id)) == 1
        assert fn.last_job.status().state == "RUNNING"      # on_stall="report": it goes on
        job_id = fn.last_job.id
        shown = subprocess.run(
            [sys.executable, "-m", "remote_tpu", "jobs", "stalls", job_id,
             "--hosts", agents.addresses[0]], capture_output=True, text=True, timeout=60,
            cwd=ROOT, env={**__import__("os").environ, "REMOTE_TPU_TOKEN": agents.token})
        assert shown.returncode == 0, shown.stderr
        assert "host 2 differs from the other 3" in shown.stdout
        fn.last_job.cancel()
    finally:
        caller.join(60)
    assert not caller.is_alive()
    said = capfd.readouterr().err
    assert said.count(f"remote_tpu: job {job_id} stalled: no host made progress") == 1, said
    assert wait_until(lambda: not live_workers(), timeout=10)


def test_on_stall_cancel_ends_the_job_with_the_stuck_host_as_its_cause(agents):
    fn = on_agents(agents, "tpu-v4-32", stall_after=STALL_AFTER, on_stall="cancel",
                   timeout=90)(_one_host_sleeps)
    started = time.monotonic()
    with pytest.raises(remote_tpu.JobFailedError) as info:
        fn()
    assert time.monotonic() - started < 60
    err = str(info.value)
    assert info.value.host == 2, err
    assert "stalled: no host made progress for" in err and "on_stall='cancel'" in err, err
    assert wait_until(lambda: not live_workers(), timeout=10)


def test_a_long_quiet_computation_that_uses_the_cpu_is_no_stall(agents):
    fn = on_agents(agents, "tpu-v4-32", stall_after=STALL_AFTER)(_busy_and_quiet)
    assert fn() is True
    assert _stalls_of(agents, fn.last_job.id) == []


def test_stall_after_off_reports_nothing(agents):
    def quiet():
        import time
        time.sleep(STALL_AFTER + 2)
        return "slept"
    fn = on_agents(agents, "tpu-v4-32", stall_after=False)(quiet)
    assert fn() == "slept"
    assert _stalls_of(agents, fn.last_job.id) == []


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc
    return None


def test_progress_calls_keep_a_loop_that_waits_from_stalling(agents):
    def waits_in_steps():
        import time

        import remote_tpu
        for step in range(12):             # 6 s of waiting, no output, no CPU
            time.sleep(0.5)
            remote_tpu.progress(step=step)
        return "done"
    fn = on_agents(agents, "tpu-v4-32", stall_after=STALL_AFTER)(waits_in_steps)
    assert fn() == "done"
    assert _stalls_of(agents, fn.last_job.id) == []
