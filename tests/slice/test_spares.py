"""Spare workers: started ahead of their job with jax imported, taken by a cold
call, replaced when used or killed, gone with their agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import Agents, alive, on_agents, wait_until

pytestmark = pytest.mark.timeout(180)


def _spares(agent_pid: int) -> list[psutil.Process]:
    """The agent's idle spare workers (named once their Python is up)."""
    found = []
    try:
        children = psutil.Process(agent_pid).children()
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            if "--spare" in child.cmdline() and child.name() == "rtpu-spare" and \
                    child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _one_spare(agent_pid: int, other_than: int = 0) -> psutil.Process:
    assert wait_until(lambda: [p for p in _spares(agent_pid) if p.pid != other_than],
                      timeout=30), "no spare worker appeared"
    return [p for p in _spares(agent_pid) if p.pid != other_than][0]


@pytest.fixture
def lone(slice_factory):
    return slice_factory(1, peers=False)


def _on(agents, **kw):
    return on_agents(agents, stream="none", **kw)


@pytest.mark.slow
def test_a_cold_call_runs_in_the_spare_and_a_new_one_is_started(lone):
    agent = lone.procs[0].pid
    spare = _one_spare(agent)
    files = {f.path for f in spare.open_files()}
    assert not any("libtpu" in f or "/dev/accel" in f or "/dev/vfio" in f for f in files)
    pid = _on(lone)(os.getpid)()
    assert pid == spare.pid                    # the call ran in the spare
    assert _one_spare(agent, other_than=pid).pid != pid


@pytest.mark.slow
def test_a_spare_taken_is_replaced_while_its_job_still_runs(lone, tmp_path):
    """Ready for a next call that follows at once (a real host's CPU is its own)."""
    agent = lone.procs[0].pid
    first = _one_spare(agent)
    go_on = tmp_path / "go-on"

    def waits() -> int:
        import os
        import time
        while not os.path.exists(str(go_on)):
            time.sleep(0.05)
        return os.getpid()

    result: list[int] = []
    call = threading.Thread(target=lambda: result.append(_on(lone)(waits)()))
    call.start()
    try:
        assert _one_spare(agent, other_than=first.pid).pid != first.pid
        assert call.is_alive()                    # before the job has ended
    finally:
        go_on.touch()
        call.join(60)
    assert result == [first.pid]


def _settled(proc: psutil.Process) -> bool:
    """Its start-up is over: no CPU used for half a second."""
    before = sum(proc.cpu_times()[:2])
    time.sleep(0.5)
    return sum(proc.cpu_times()[:2]) == before


@pytest.mark.slow
def test_after_a_call_without_jax_the_spare_is_light_and_still_runs_a_jax_call(lone):
    agent = lone.procs[0].pid
    first = _one_spare(agent)
    assert _on(lone, init_jax=False)(os.getpid)() == first.pid
    light = _one_spare(agent, other_than=first.pid)
    assert wait_until(lambda: _settled(light), timeout=30)
    assert b"REMOTE_TPU_INIT_JAX=0" in open(f"/proc/{light.pid}/environ", "rb").read()
    assert not [m.path for m in light.memory_maps() if "jaxlib" in m.path]   # never imported

    def with_jax():
        import os

        import jax
        return os.getpid(), jax.process_count()

    assert _on(lone)(with_jax)() == (light.pid, 1)        # jax imported in the call
    heavy = _one_spare(agent, other_than=light.pid)       # a JAX job: the next has jax
    assert wait_until(lambda: [m for m in heavy.memory_maps() if "jaxlib" in m.path],
                      timeout=60)


@pytest.mark.slow
def test_a_job_with_its_own_env_gets_a_worker_started_with_it(lone):
    spare = _one_spare(lone.procs[0].pid)

    def threads():
        import os

        import numpy  # noqa: F401 - loads OpenBLAS, which reads the variable now
        return os.getpid(), open(f"/proc/{os.getpid()}/environ", "rb").read()

    pid, environ = _on(lone, env={"OPENBLAS_NUM_THREADS": "1"})(threads)()
    assert pid != spare.pid and spare.is_running()       # the spare is still there
    assert b"OPENBLAS_NUM_THREADS=1" in environ          # set as the process started


@pytest.mark.slow
def test_a_spare_killed_by_hand_is_replaced(lone):
    agent = lone.procs[0].pid
    first = _one_spare(agent)
    first.send_signal(signal.SIGKILL)
    second = _one_spare(agent, other_than=first.pid)
    assert second.pid != first.pid
    assert _on(lone)(lambda: 5)() == 5


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_no_spare_outlives_its_agent(how):
    agents = Agents(1, peers=False)
    try:
        spare = _one_spare(agents.procs[0].pid)
        agents.procs[0].send_signal(how)
        agents.procs[0].wait(15)
        assert wait_until(lambda: not alive(spare), timeout=10), \
            "the spare worker outlived its agent"
    finally:
        agents.stop()


@pytest.mark.slow
def test_no_spare_when_the_agent_is_told_so():
    agents = Agents(1, peers=False, extra=["--spare-workers", "0"])
    try:
        assert _on(agents)(lambda: 1)() == 1
        assert not wait_until(lambda: _spares(agents.procs[0].pid), timeout=3)
    finally:
        agents.stop()


@pytest.mark.slow
def test_a_light_spare_is_replaced_only_once_the_cpus_are_idle_again():
    """Many simulated hosts share one machine: a replacement started while the
    call's other hosts still run would take their CPU (64 hosts: twice the call)."""
    agents = Agents(1, peers=False, extra=["--light-spares"])
    try:
        agent = agents.procs[0].pid
        first = _one_spare(agent)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
        try:
            for _ in range(3):          # takes while it waits: still one spare to come
                pid = _on(agents, init_jax=False)(os.getpid)()
                assert pid == first.pid or not _spares(agent)
            assert not wait_until(lambda: _spares(agent), timeout=3), \
                "a spare was started while every CPU was busy"
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        assert _one_spare(agent).pid != first.pid       # the CPUs idle again: at once
        time.sleep(1)
        assert len(_spares(agent)) == 1
    finally:
        agents.stop()
