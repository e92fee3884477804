"""The client's retries (an agent that is not up yet) and Submit's upload deadline."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import remote_tpu
from conftest import Agents, alive, free_port, wait_until
from remote_tpu._core.auth import TOKEN_ENV, new_token

pytestmark = pytest.mark.timeout(120)

ACCELERATOR = "tpu-v5litepod-4"      # one host: one agent is the whole slice
NOTICE = "remote_tpu: no agent answered at"


class _LateAgent:
    """A real `remote-tpu-agent` on ``port``, started ``delay`` seconds from now
    (an agent that is restarting when the call begins)."""

    def __init__(self, port: int, token: str, delay: float, state_dir: str) -> None:
        self.cmd = [sys.executable, "-m", "remote_tpu_agent", "--port", str(port),
                    "--simulate-devices", "2", "--state-dir", state_dir,
                    "--log-level", "WARNING"]
        self.env = {**os.environ, TOKEN_ENV: token}
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self._timer = threading.Timer(delay, self._start)
        self._timer.start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.started_at = time.monotonic()

    def stop(self) -> None:
        self._timer.cancel()
        self._timer.join()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _WatchedStdout(io.StringIO):
    """A sys.stdout stand-in that says when ``text`` was written to it."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.text in self.getvalue():
            self.seen.set()
        return n


def _answer():
    print("hello from the late agent")
    return 42


def _answered_once(port: int, token: str, state_dir: str) -> None:
    """A real agent on ``port`` answers a call, then stops: this machine
    has seen it, as one whose agent restarts has."""
    agent = _LateAgent(port, token, delay=0, state_dir=state_dir)
    try:
        f = remote_tpu.run(accelerator=ACCELERATOR, hosts=f"127.0.0.1:{port}", token=token,
                           init_jax=False)(_answer)
        assert wait_until(lambda: _listening(port), 30)
        assert f() == 42
    finally:
        agent.stop()


def _listening(port: int) -> bool:
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("how", ["call", "submit"])
def test_agent_coming_up_two_seconds_late_is_waited_for(how, tmp_path, capsys):
    port, token = free_port(), new_token()
    _answered_once(port, token, str(tmp_path))     # (in this process: a new one reads
    capsys.readouterr()                             #  the same record, test below)
    agent = _LateAgent(port, token, delay=2.0, state_dir=str(tmp_path))
    try:
        f = remote_tpu.run(accelerator=ACCELERATOR, hosts=f"127.0.0.1:{port}", token=token)(
            _answer)
        start = time.monotonic()
        if how == "call":
            assert f() == 42
        else:
            handle = f.submit()
            submitted = time.monotonic() - start
            assert handle.result() == 42
        elapsed = time.monotonic() - start
    finally:
        agent.stop()
    out, err = capsys.readouterr()
    assert NOTICE in err and f"127.0.0.1:{port}" in err
    assert err.count(NOTICE) == 1, "the notice is printed once per call, not per attempt"
    if how == "call":
        assert "hello from the late agent" in out
    else:
        assert submitted < 15, f"submit took {submitted:.1f} s"
    assert elapsed < 60, f"{how} took {elapsed:.1f} s"


@pytest.mark.slow
def test_the_memory_of_an_answer_outlives_the_process(tmp_path):
    port, token = free_port(), new_token()
    _answered_once(port, token, str(tmp_path))
    code = (f"from remote_tpu import _answered; print(_answered.before('127.0.0.1:{port}'), "
            "_answered.before('127.0.0.1:1'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr


@pytest.mark.slow
def test_run_is_not_retried_once_an_event_arrived(monkeypatch, capsys):
    agents = Agents(1)
    stdout = _WatchedStdout("in the job")
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        @remote_tpu.run(accelerator=ACCELERATOR, hosts=agents.addresses[0],
                        token=agents.token)
        def waits():
            print("in the job", flush=True)
            time.sleep(120)

        errors: list[BaseException] = []

        def attached() -> None:
            try:
                waits()
            except BaseException as exc:      # handed to the test thread
                errors.append(exc)

        t = threading.Thread(target=attached)
        t.start()
        assert stdout.seen.wait(60), "the job's output never arrived"
        workers = psutil.Process(agents.procs[0].pid).children(recursive=True)
        killed = time.monotonic()
        agents.procs[0].kill()           # the connection drops after an event arrived
        t.join(30)
        assert not t.is_alive()
        assert time.monotonic() - killed < 5, "the call was retried after an event"
        assert isinstance(errors[0], remote_tpu.AgentUnavailableError), errors
        assert workers and wait_until(lambda: not any(map(alive, workers)), timeout=10), \
            "a worker outlived its agent"
    finally:
        agents.stop()
    assert NOTICE not in capsys.readouterr().err


@pytest.mark.slow
def test_a_tunnel_that_accepts_and_closes_while_its_agent_is_down_is_retried(tmp_path,
                                                                            capsys):
    # `ssh -L` accepts a connection and closes it when nothing listens behind it.
    import socket
    port, token = free_port(), new_token()
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.1)

    def tunnel_without_agent(until: float) -> None:
        while time.monotonic() < until:
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                pass
        listener.close()
    from remote_tpu import _answered
    _answered.note(f"127.0.0.1:{port}")          # its agent answered before, and restarts
    threading.Thread(target=tunnel_without_agent, args=(time.monotonic() + 2.0,),
                     daemon=True).start()
    agent = _LateAgent(port, token, delay=2.3, state_dir=str(tmp_path))
    try:
        f = remote_tpu.run(accelerator=ACCELERATOR, hosts=f"127.0.0.1:{port}", token=token)(
            _answer)
        assert f() == 42
    finally:
        agent.stop()
    assert capsys.readouterr().err.count(NOTICE) == 1
