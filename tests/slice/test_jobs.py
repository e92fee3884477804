"""Jobs that outlive the call: submit, attach, logs, cancel, timeouts and stacks,
queueing, restarts, and fault injection. Real agents on loopback."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import remote_tpu
from conftest import Agents, alive, live_workers, wait_until
from remote_tpu import _client
from remote_tpu._core.serialization import dumps_call

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _on(agents, accelerator="tpu-v4-16", **kw):
    return remote_tpu.run(accelerator=accelerator, hosts=agents.addresses[0],
                          token=agents.token, **kw)


def _workers_of(job_id: str) -> dict[int, psutil.Process]:
    found = {}
    for p in live_workers():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("REMOTE_TPU_JOB_ID") == job_id:
            found[int(env["REMOTE_TPU_HOST_INDEX"])] = p
    return found


def _cli(*args: str, agents: Agents) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_tpu", *args, "--hosts",
                           agents.addresses[0]], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "REMOTE_TPU_TOKEN": agents.token})


def test_submit_then_die_then_attach_elsewhere_follow_logs_and_result_twice(pair, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, time, remote_tpu

        @remote_tpu.run(accelerator="tpu-v4-16", hosts={pair.addresses[0]!r},
                        token={pair.token!r})
        def slow_count(n):
            import jax
            for i in range(n):
                print(f"step {{i}} on host {{jax.process_index()}}", flush=True)
                time.sleep(0.2)
            return {{"steps": n, "host": jax.process_index()}}

        handle = slow_count.submit(8)
        print(handle.id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)      # the laptop lid closes
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    job_id = proc.stdout.strip()

    handle = remote_tpu.attach(job_id, hosts=pair.addresses[0], token=pair.token)
    followed = "".join(handle.logs(follow=True))
    assert followed == "".join(f"step {i} on host 0\n" for i in range(8))
    assert handle.logs(host=1) == "".join(f"step {i} on host 1\n" for i in range(8))
    assert handle.status().state == "SUCCEEDED"
    assert handle.result() == {"steps": 8, "host": 0}
    assert handle.result() == {"steps": 8, "host": 0}        # collected twice

    assert job_id in _cli("jobs", "list", agents=pair).stdout
    logs = _cli("jobs", "logs", job_id, "--host", "1", agents=pair)
    assert logs.returncode == 0 and "step 7 on host 1" in logs.stdout
    assert "{'steps': 8, 'host': 0}" in _cli("jobs", "result", job_id, agents=pair).stdout


def test_attach_to_an_unknown_job_says_so(pair):
    with pytest.raises(remote_tpu.RemoteTPUError, match="has no job 'nope-123'"):
        remote_tpu.attach("nope-123", hosts=pair.addresses[0], token=pair.token)
    with pytest.raises(remote_tpu.ConfigurationError, match="local slice lives only as long"):
        remote_tpu.attach("x", hosts="local")


def test_duplicate_submission_runs_once_and_jobs_queue_in_order(pair, tmp_path):
    counter = tmp_path / "runs"

    @_on(pair)
    def count_runs(seconds):
        import jax
        if jax.process_index() == 0:
            with open(counter, "a") as f:
                f.write("x")
        time.sleep(seconds)
        return seconds

    options = count_runs.options
    payload = dumps_call(count_runs.local, (1.5,), {})
    first = _client.submit(options, payload, "dup-job-1")
    again = _client.submit(options, payload, "dup-job-1")       # a retried submission
    second = count_runs.submit(0.1)
    status = second.status()
    assert status.state == "QUEUED" and status.queued_behind == "dup-job-1"
    assert status.queue_position == 1
    assert first.result() == again.result() == 1.5
    assert second.result() == 0.1
    assert counter.read_text() == "xx"                            # dup-job-1 once, then second
    assert second.status().started_at >= first.status().ended_at


def test_cancel_a_running_and_a_queued_job(pair):
    @_on(pair)
    def sleeper():
        time.sleep(120)

    running, queued = sleeper.submit(), sleeper.submit()
    assert wait_until(lambda: len(_workers_of(running.id)) == 2, 60)
    assert queued.cancel().state == "CANCELLED"
    assert running.status().state == "RUNNING"
    start = time.monotonic()
    assert running.cancel().state == "CANCELLED"
    assert time.monotonic() - start < 5
    assert not _workers_of(running.id)
    with pytest.raises(remote_tpu.JobFailedError, match="cancelled on request"):
        running.result()


def test_timeout_shows_where_each_host_is_stuck(pair):
    @_on(pair, timeout=6)
    def stuck_on_host_1():
        import jax
        from jax.experimental import multihost_utils
        if jax.process_index() == 1:
            while True:
                time.sleep(0.1)       # alive but stuck: JAX's heartbeat cannot tell
        multihost_utils.sync_global_devices("host 0 waits for host 1 here")

    handle = stuck_on_host_1.submit()
    assert wait_until(lambda: len(_workers_of(handle.id)) == 2, 60)
    live = {}

    def settled() -> bool:
        """Host 0 waits in the collective, host 1 loops: where they stay."""
        try:
            live.update(handle.stacks())
        except remote_tpu.RemoteTPUError:          # not running yet
            return False
        return ("sync_global_devices" in live.get(0, "")
                and "stuck_on_host_1" in live.get(1, ""))
    assert wait_until(settled, timeout=5, interval=0.25), live
    assert "stuck_on_host_1" in live[1] and "time.sleep" not in live[0]
    assert "sync_global_devices" in live[0]
    with pytest.raises(remote_tpu.JobTimeoutError) as info:
        handle.result()
    msg = str(info.value)
    assert "timed out after 6 s" in msg and "Where each host was at the timeout" in msg
    host0, host1 = msg.split("===== host 0 =====")[1].split("===== host 1 =====")
    assert "sync_global_devices" in host0
    assert "stuck_on_host_1" in host1 and "sync_global_devices" not in host1
    assert not _workers_of(handle.id)
    stacks = _cli("jobs", "stacks", handle.id, agents=pair)
    assert stacks.returncode == 1 and "not running" in stacks.stderr


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_attached_caller_interrupted_or_killed_cancels_the_job(pair, tmp_path, how):
    script = textwrap.dedent(f"""
        import time, remote_tpu

        @remote_tpu.run(accelerator="tpu-v4-16", hosts={pair.addresses[0]!r},
                        token={pair.token!r})
        def attached():
            import os
            print(os.environ["REMOTE_TPU_JOB_ID"], flush=True)
            time.sleep(120)

        try:
            attached()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=str(tmp_path))
    job_id = proc.stdout.readline().strip()
    assert wait_until(lambda: len(_workers_of(job_id)) == 2, 60)
    start = time.monotonic()
    proc.send_signal(getattr(signal, how))
    if how == "SIGINT":
        assert proc.stdout.readline().strip() == "interrupted"
    assert wait_until(lambda: not _workers_of(job_id), 5), "workers outlived their caller"
    elapsed = time.monotonic() - start
    assert elapsed < (2 if how == "SIGINT" else 5)
    proc.wait(10)
    handle = remote_tpu.attach(job_id, hosts=pair.addresses[0], token=pair.token)
    status = handle.wait(10)
    assert status.state == "CANCELLED" and "attached caller went away" in status.detail


def test_agent_restart_keeps_finished_jobs_and_marks_the_running_one_lost(tmp_path):
    agents = Agents(1, peers=False, extra=["--spare-workers", "0"])    # see pair()
    try:
        @_on(agents, accelerator="tpu-v5litepod-4")
        def say(text, sleep):
            print(text, flush=True)
            time.sleep(sleep)
            return text.upper()

        done = say.submit("finished before the crash", 0)
        assert done.result() == "FINISHED BEFORE THE CRASH"
        running = say.submit("running at the crash", 120)
        assert wait_until(lambda: running.logs() == "running at the crash\n", 60)
        worker = _workers_of(running.id)[0]
        agents.procs[0].kill()
        assert wait_until(lambda: not alive(worker), 5), \
            "the worker outlived its agent"
        agents.restart(0)
        done = remote_tpu.attach(done.id, hosts=agents.addresses[0], token=agents.token)
        assert done.result() == "FINISHED BEFORE THE CRASH"
        assert done.logs() == "finished before the crash\n"
        lost = remote_tpu.attach(running.id, hosts=agents.addresses[0], token=agents.token)
        status = lost.status()
        assert status.state == "LOST" and "restarted while the job was running" in status.detail
        assert lost.logs() == "running at the crash\n"
        with pytest.raises(remote_tpu.JobFailedError, match="was lost"):
            lost.result()
        assert say("after the restart", 0) == "AFTER THE RESTART"
    finally:
        agents.stop()


def test_random_worker_killed_at_random_moments_fails_fast_naming_it(pair):
    @_on(pair)
    def work():
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("start")
        time.sleep(30)

    rng = random.Random(1234)
    deadline = time.monotonic() + 120
    trials = 0
    while trials < 10 and time.monotonic() < deadline:
        handle = work.submit()
        assert wait_until(lambda: len(_workers_of(handle.id)) == 2, 60)
        time.sleep(rng.uniform(0.0, 2.0))     # before, during or after JAX initialization
        victim = rng.randrange(2)
        _workers_of(handle.id)[victim].kill()
        killed_at = time.time()
        status = handle.wait(10)
        assert status.state == "FAILED"
        assert status.ended_at - killed_at < 5, f"trial {trials}: {status.ended_at - killed_at}"
        with pytest.raises(remote_tpu.JobFailedError) as info:
            handle.result()
        assert info.value.host == victim, f"trial {trials}: {info.value}"
        assert "killed by SIGKILL" in str(info.value)
        assert not _workers_of(handle.id)
        trials += 1
    assert trials >= 10
    assert _on(pair)(lambda: "still fine")() == "still fine"


def test_two_hundred_tiny_jobs_keep_the_agent_flat():
    agents = Agents(1, peers=False, extra=["--keep-jobs", "50"])
    try:
        tiny = _on(agents, accelerator="tpu-v5litepod-4", init_jax=False)(
            lambda i: print(i) or i)          # a log each; no JAX: the agent is under test
        agent = psutil.Process(agents.procs[0].pid)
        for i in range(20):
            assert tiny(i) == i
        rss, fds = agent.memory_info().rss, agent.num_fds()
        for i in range(180):
            assert tiny(i) == i
        rss_growth = agent.memory_info().rss - rss
        fd_growth = agent.num_fds() - fds
        assert rss_growth < 40 << 20, f"agent memory grew {rss_growth >> 20} MiB"
        assert fd_growth < 10, f"agent file descriptors grew by {fd_growth}"
        kept = remote_tpu.jobs(hosts=agents.addresses[0], token=agents.token)
        assert len(kept) == 50
        assert len(os.listdir(os.path.join(agents.state_dirs[0], "jobs"))) == 50
    finally:
        agents.stop()
