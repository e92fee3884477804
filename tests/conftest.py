"""Shared helpers. Tests run real agents on loopback and real multi-process JAX on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job_processes() -> list[psutil.Process]:
    """Every live worker or agent process started by remote_tpu on this machine."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "remote_tpu_agent" in cmd and p.pid != os.getpid():
            found.append(p)
    return found


def live_workers() -> list[psutil.Process]:
    out = []
    for p in job_processes():
        try:
            if "remote_tpu_agent._worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def run_python(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (its own __main__), capturing output."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", ROOT), **kwargs)


@pytest.fixture
def no_leftover_workers():
    """Fails the test if a worker process outlives it: the gateway confirms every
    host's exit before it reports, so none may be left once the call has returned."""
    yield
    assert wait_until(lambda: not live_workers(), timeout=0.5), \
        f"worker processes left behind: {[p.cmdline() for p in live_workers()]}"


@pytest.fixture(autouse=True, scope="session")
def _private_config_home(tmp_path_factory):
    """Agents create a default token file when none is configured: never in the
    real home of whoever runs the tests."""
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config-home"))
    for name in ("REMOTE_TPU_TOKEN", "REMOTE_TPU_TOKEN_FILE", "REMOTE_TPU_TLS_CA",
                 "REMOTE_TPU_HOSTS"):
        os.environ.pop(name, None)
    yield
    if old is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = old
