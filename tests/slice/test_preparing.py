"""Preparing a job (its requirements= installed, its interpreter set up, its
trees placed) is part of the job: bounded by its timeout=, ended by a cancel
or by its attached caller going away (the installer's whole process group
killed), its output the job's as it comes; the queue never waits for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import remote_tpu

from conftest import ROOT, Agents, alive, wait_until
from package_index import PackageIndex, make_wheel

# Two agents that are not told of each other: a job names its hosts.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.agents(peers=False)]

# Past the job's end: its installer's group killed; a cancel answered.
_WITHIN = 2.0


@pytest.fixture(autouse=True)
def _no_installer_left(agents):
    """(Where a test failed, the hanging installer would hold its agent for minutes.)"""
    yield
    for i in range(2):
        _kill(_installers(agents, i))


@pytest.fixture
def index(tmp_path):
    make_wheel(str(tmp_path), "rtpu_test_slow")
    served = PackageIndex(str(tmp_path))
    yield served
    served.close()


def _installers(agents: Agents, i: int) -> list[psutil.Process]:
    """The installer processes agent ``i`` runs (and their children)."""
    found = []
    for p in psutil.Process(agents.procs[i].pid).children(recursive=True):
        try:
            if "pip" in " ".join(p.cmdline()) and alive(p):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _on(agents: Agents, hosts: int, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16" if hosts == 2 else "tpu-v5litepod-4",
                          hosts=",".join(agents.addresses[:hosts]), token=agents.token,
                          init_jax=False, **kw)


def _requirements(index: PackageIndex) -> list[str]:
    return [f"--index-url {index.url}", "rtpu-test-slow"]


def _hanging(agents: Agents, i: int, index: PackageIndex) -> list[psutil.Process]:
    """Agent ``i``'s installer, once it has asked the silent index."""
    assert wait_until(lambda: index.requests and _installers(agents, i), 60), \
        f"agent {i} never ran its installer"
    return _installers(agents, i)


def _gone(procs: list[psutil.Process], within: float = _WITHIN) -> bool:
    return wait_until(lambda: not any(alive(p) for p in procs), within)


def test_a_hanging_install_ends_at_the_timeout_and_the_next_job_runs_at_once(agents, index):
    index.silent.set()
    stuck = _on(agents, 1, requirements=_requirements(index), timeout=8)(lambda: 1)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            stuck()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - examined below
            outcome.append(exc)
    started = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    pip = _hanging(agents, 0, index)
    behind = _on(agents, 1)(lambda: "next").submit()
    thread.join(8 + _WITHIN + 2)
    assert outcome, f"the call was still blocked {time.monotonic() - started:.0f} s " \
                    "after it started, with timeout=8"
    assert isinstance(outcome[0], remote_tpu.JobTimeoutError), outcome[0]
    assert "timed out after 8 s" in str(outcome[0])
    ended = time.monotonic()
    assert _gone(pip), "the installer outlived its job"
    assert behind.result(timeout=30) == "next"
    assert time.monotonic() - ended < 10, "the job queued behind it waited"


def test_a_cancel_ends_a_hanging_install_and_its_output_was_the_jobs(agents, index):
    index.silent.set()
    handle = _on(agents, 1, requirements=_requirements(index))(lambda: 1).submit()
    pip = _hanging(agents, 0, index)
    assert wait_until(lambda: index.url in handle.logs(), 30), handle.logs()
    assert "making an environment" in handle.logs()
    asked = time.monotonic()
    status = handle.cancel()
    assert status.state == "CANCELLED", status
    assert time.monotonic() - asked < _WITHIN, "the cancel waited for the installer"
    assert _gone(pip), "the installer outlived its job"


def test_an_attached_caller_going_away_ends_a_hanging_install(agents, index):
    index.silent.set()
    code = (f"import remote_tpu\nremote_tpu.run(accelerator='tpu-v5litepod-4', "
            f"hosts={agents.addresses[0]!r}, token={agents.token!r}, init_jax=False, "
            f"requirements={_requirements(index)!r})(lambda: 1)()\n")
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pip = _hanging(agents, 0, index)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    assert _gone(pip), "the installer outlived its attached caller"


def test_a_peers_hanging_install_is_cancelled_and_frees_the_peer(agents, index):
    # Host 0 makes the environment while the index answers; host 1 then finds it silent.
    reqs = _requirements(index)
    assert _on(agents, 1, requirements=reqs)(lambda: 1)() == 1
    index.silent.set()
    handle = _on(agents, 2, requirements=reqs)(lambda: 1).submit()
    pip = _hanging(agents, 1, index)
    assert wait_until(lambda: index.url in handle.logs(host=1), 30), handle.logs(host=1)
    asked = time.monotonic()
    assert handle.cancel().state == "CANCELLED"
    assert time.monotonic() - asked < _WITHIN, "the cancel waited for the peer's installer"
    assert _gone(pip), "the peer's installer outlived its job"
    assert _on(agents, 2)(os.getpid)() > 0           # the peer takes the next job at once
