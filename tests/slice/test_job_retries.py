"""retries= on real agents: a worker that dies, a function that fails, a host
that vanishes or that its metadata calls preempted; the caller's own retries
and a submitted job's gateway's, with the attempts listed in the job's
status. The rules without agents: tests/unit/test_retries.py."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

import remote_tpu
from conftest import Agents, wait_until
from metadata_server import MetadataSlice
from remote_tpu._core.exceptions import JobFailedError
from remote_tpu._retries import Retries

pytestmark = pytest.mark.timeout(180)


def _dies_once():
    """Host 1's worker kills itself in attempt 0; the attempt that worked."""
    import os
    import signal
    attempt = int(os.environ.get("REMOTE_TPU_ATTEMPT", "0"))
    if attempt == 0 and os.environ["REMOTE_TPU_HOST_INDEX"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"attempt {attempt} on host {os.environ['REMOTE_TPU_HOST_INDEX']}", flush=True)
    return attempt


def test_a_worker_killed_in_attempt_0_is_retried_by_the_caller(agents, capfd):
    # retries=1, without its 10 s backoff
    assert _on(agents, retries=Retries(preemptions=1, failures=1, backoff=0))(_dies_once)() == 1
    assert "attempt 0 ended by a failure" in capfd.readouterr().err
    newest = remote_tpu.jobs(agents.addresses[0], token=agents.token, limit=1)[0]
    assert [(a.number, a.kind) for a in newest.attempts] == [(0, "failure")]
    assert "SIGKILL" in newest.attempts[0].cause and newest.attempts[0].job_id
    with pytest.raises(JobFailedError, match="host 1 of 2 .*SIGKILL"):
        _on(agents, retries=0)(_dies_once)()


def test_a_submitted_job_is_retried_by_its_gateway_under_one_job_id(agents):
    handle = _on(agents, retries=Retries(failures=1, backoff=0))(_dies_once).submit()
    assert handle.result() == 1
    status = handle.status()
    assert status.state == "SUCCEEDED"
    assert [(a.number, a.kind, a.job_id) for a in status.attempts] == [
        (0, "failure", handle.id)]
    assert "host 1" in status.attempts[0].cause and "SIGKILL" in status.attempts[0].cause
    log = handle.logs()
    assert "remote_tpu: attempt 0 ended by a failure" in log
    assert "attempt 1 starts in 0 s (1 of 1 failure retries)" in log
    assert "attempt 1 on host 0" in log


def test_when_a_submitted_jobs_retries_run_out_its_error_names_every_attempt(agents):
    def always():
        import os
        raise RuntimeError(f"broke in attempt {os.environ['REMOTE_TPU_ATTEMPT']}")

    handle = _on(agents, retries=Retries(failures=2, preemptions=0, backoff=0))(always).submit()
    status = handle.wait(60)
    assert status.state == "FAILED" and len(status.attempts) == 2
    with pytest.raises(RuntimeError, match="broke in attempt 2") as info:
        handle.result()
    notes = "\n".join(info.value.__notes__)
    assert re.search(r"this was attempt 2 \(its failure retries were spent; earlier attempts: "
                     r"attempt 0 \(failure\): host \d raised builtins.RuntimeError: broke in "
                     r"attempt 0; attempt 1 \(failure\)", notes), notes


def test_a_job_cancelled_between_attempts_ends_at_once(agents):
    def always():
        raise RuntimeError("no luck")

    handle = _on(agents, retries=Retries(failures=3, backoff=60))(always).submit()
    assert wait_until(lambda: handle.status().attempts, 30)
    assert handle.status().state == "RUNNING"         # waiting 60 s for attempt 1
    started = time.monotonic()
    status = handle.cancel()
    status = handle.wait(10)
    assert status.state == "CANCELLED" and time.monotonic() - started < 5
    assert "between attempts 0 and 1" in status.detail


@pytest.mark.slow
def test_a_host_its_metadata_calls_preempted_is_retried_under_preemptions(tmp_path):
    """failures=0: only the preemption's own budget can retry it."""
    vm = MetadataSlice("v4-16", 2)
    marker = tmp_path / "pid"
    try:
        @remote_tpu.run(accelerator="tpu-v4-16", hosts=vm.addresses[0], token=vm.token,
                        init_jax=False, retries=Retries(preemptions=1, failures=0, backoff=0))
        def step(marker):
            import os
            import time
            attempt = int(os.environ["REMOTE_TPU_ATTEMPT"])
            if attempt == 0 and os.environ["REMOTE_TPU_HOST_INDEX"] == "0":
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60)             # GCE takes the VM back meanwhile
            return attempt

        def preempt():
            assert wait_until(lambda: marker.exists() and marker.read_text(), 60)
            vm.servers[0].instance["preempted"] = "TRUE"
            os.kill(int(marker.read_text()), signal.SIGKILL)

        helper = threading.Thread(target=preempt, daemon=True)
        helper.start()
        handle = step.submit(str(marker))
        assert handle.result() == 1
        helper.join(10)
        [attempt] = handle.status().attempts
        assert (attempt.kind, attempt.state) == ("preemption", "PREEMPTED"), attempt
        assert "preempted" in attempt.cause
    finally:
        vm.stop()


@pytest.mark.slow
def test_the_checkpoint_resume_example_restores_what_attempt_0_saved(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "checkpoint_resume.py"),
                           "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "8",
                           "--kill-at", "3"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attempt 0 ended by a failure (host 1 killed by SIGKILL)" in proc.stderr
    assert "attempt 1: restored step 3" in proc.stdout
    assert "'resumed_from': 3, 'step': 8, 'w_all_equal_steps': True" in proc.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["7", "8"]      # max_to_keep=2


def test_a_peer_that_refuses_the_gateway_is_not_retried(capfd):
    """A wrong token on one host: nothing ran, and asking again cannot help."""
    from remote_tpu._core.auth import new_token

    mixed = Agents(2, tokens=[new_token(), new_token()])
    try:
        fn = remote_tpu.run(accelerator="tpu-v4-16", hosts=mixed.addresses[0],
                            token=mixed.token, init_jax=False, stream="none", retries=5)(len)
        with pytest.raises(JobFailedError, match="nothing was started on any host"):
            fn([])
        assert "retrying" not in capfd.readouterr().err
        # The same with a large argument, whose buffers the peer is asked about first.
        import numpy as np
        with pytest.raises(JobFailedError, match="nothing was started on any host") as err:
            fn(np.zeros(2_000_000))
        assert "refused this client's credentials" in str(err.value)
        assert "retrying" not in capfd.readouterr().err
        handle = fn.submit([])
        status = handle.wait(30)
        assert status.state == "FAILED" and status.attempts == ()
    finally:
        mixed.stop()


def _on(agents, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, init_jax=False, stream="none", **kw)


def _flaky(until: int):
    """Raises on its first attempts; returns the attempt that worked."""
    import os
    attempt = int(os.environ["REMOTE_TPU_ATTEMPT"])
    if attempt < until:
        raise RuntimeError(f"attempt {attempt} broke")
    return attempt


def test_a_failure_is_retried_as_often_as_allowed(agents, capfd):
    fn = _on(agents, retries=Retries(failures=2, backoff=0))(_flaky)
    assert fn(2) == 2
    err = capfd.readouterr().err
    assert err.count("retrying") == 2
    assert re.search(r"ended by a failure \(host \d raised builtins.RuntimeError: attempt 0 broke",
                     err), err
    with pytest.raises(RuntimeError, match="attempt 2 broke") as info:
        fn(3)
    notes = "".join(info.value.__notes__)
    assert "earlier attempts ended by" in notes and "attempt 0 broke" in notes
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="attempt 0 broke"):
        _on(agents, retries=Retries(preemptions=5, backoff=0))(_flaky)(1)   # failures: 0
    assert "retrying" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_host_that_vanishes_is_a_preemption_retried_until_it_is_back(agents, tmp_path, capfd):
    started = tmp_path / "started"

    def long_job(marker):
        import os
        import time
        attempt = int(os.environ["REMOTE_TPU_ATTEMPT"])
        if attempt == 0:
            open(marker, "w").close()
            time.sleep(60)                 # host 1's agent is killed meanwhile
        return attempt

    def kill_and_restart():
        wait_until(started.exists, timeout=60)
        agents.procs[1].send_signal(signal.SIGKILL)
        time.sleep(1)
        agents.restart(1)

    helper = threading.Thread(target=kill_and_restart, daemon=True)
    helper.start()
    fn = _on(agents, retries=Retries(preemptions=10, failures=0, backoff=0.5, backoff_max=2))
    assert fn(long_job)(str(started)) >= 1
    helper.join(30)
    assert "ended by a preemption" in capfd.readouterr().err
    assert os.path.exists(started)
