"""retries= on real agents: a worker that dies, a host its metadata calls
preempted; the caller's own retries and a submitted job's gateway's, with
the attempts listed in the job's status."""

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
from test_retries import _on

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


def test_a_gateway_never_reached_is_not_retried_but_one_lost_later_is(capfd):
    from remote_tpu._core.exceptions import AgentUnavailableError
    from remote_tpu._retries import run

    calls = []

    def never_there(attempt, earlier):
        calls.append(attempt)
        raise AgentUnavailableError("no remote_tpu agent answered at 10.0.0.9:8475")

    with pytest.raises(AgentUnavailableError):
        run(Retries(preemptions=5, backoff=0), never_there)
    assert calls == [0] and "retrying" not in capfd.readouterr().err     # a wrong address

    def lost_then_back(attempt, earlier):
        calls.append(attempt)
        if attempt == 1:
            raise AgentUnavailableError("the gateway went away")   # reached once: a loss
        if attempt == 0:
            raise _ended_by_a_lost_host()
        return [a.kind for a in earlier]

    calls.clear()
    assert run(Retries(preemptions=5, backoff=0), lost_then_back) == ["preemption"] * 2
    assert calls == [0, 1, 2]


def _ended_by_a_lost_host() -> Exception:
    from remote_tpu._core.proto import remote_tpu_pb2 as pb

    exc = JobFailedError("host 1 lost")
    exc.remote_tpu_end = pb.JobEnd(state=pb.JOB_STATE_LOST, root_cause_host=1, hosts=[
        pb.HostReport(host=0), pb.HostReport(host=1, state=pb.HOST_STATE_LOST)])
    return exc


def test_every_worker_is_told_its_attempt_even_without_retries():
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu_agent.worker.environment import worker_env

    def attempt(**kw):
        spec = pb.JobSpec(job_id="j", accelerator="tpu-v4-16", num_hosts=2, **kw)
        return worker_env({}, spec=spec, process_id=0, coordinator="h:1",
                          simulate_devices=2)["REMOTE_TPU_ATTEMPT"]

    assert attempt() == "0"                     # a warm worker never keeps an earlier one
    assert attempt(retries=pb.RetryPolicy(failures=1), attempt=2) == "2"
    assert attempt(env={"REMOTE_TPU_ATTEMPT": "3"}) == "3"       # the caller's own count


def test_a_cancel_while_an_attempt_winds_down_is_not_lost(tmp_path):
    """The window between an attempt's end and its backoff: the scheduler
    still holds the job, so a cancel ends it instead of the next attempt."""
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu_agent.gateway.scheduler import Scheduler
    from remote_tpu_agent.jobs.store import JobStore

    ended, go_on, runs = threading.Event(), threading.Event(), []

    class Winding:
        """A job whose end is reported before its run() has wound down."""
        n, session_id = 1, ""

        def __init__(self, record):
            self.record = record

        def cancel(self, reason, state=pb.JOB_STATE_CANCELLED):
            pass

        def kept_session(self, store):
            return None

        def run(self):
            runs.append(self.record.spec.attempt)
            yield pb.Event(end=pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=0, hosts=[
                pb.HostReport(host=0, state=pb.HOST_STATE_FAILED, detail="boom")]))
            if len(runs) == 1:
                ended.set()
                go_on.wait(10)

    store = JobStore(str(tmp_path))
    scheduler = Scheduler(lambda record, warm: Winding(record))
    spec = pb.JobSpec(job_id="j1", accelerator="tpu-v4-8", num_hosts=1, role=pb.ROLE_GATEWAY,
                      retries=pb.RetryPolicy(failures=3, backoff_seconds=0.2,
                                             backoff_max_seconds=0.2))
    record, _ = store.create(spec, pb.ROLE_GATEWAY)
    try:
        scheduler.submit(record)
        assert ended.wait(10)
        assert scheduler.cancel("j1", "cancelled on request")
        go_on.set()
        assert wait_until(lambda: record.finished, 10)
        assert record.status.phase == pb.JOB_PHASE_CANCELLED and runs == [0]
    finally:
        go_on.set()
        scheduler.shutdown("test over")
