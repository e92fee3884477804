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
from remote_tpu._client import upload_deadline

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


def test_the_memory_of_agents_that_answered_is_kept_in_owner_only_directories(
        tmp_path, monkeypatch):
    """$XDG_STATE_HOME/remote_tpu/answered: each directory made on the way is
    0700 (as the XDG spec asks); one that was there keeps its mode."""
    from conftest import mode, umask
    from remote_tpu import _answered
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    monkeypatch.setattr(_answered, "_known", None)
    with umask(0):
        _answered.note("127.0.0.1:8475")
    for made in (home / ".local", home / ".local" / "state",
                 home / ".local" / "state" / "remote_tpu"):
        assert mode(made) == 0o700, made
    assert mode(home) == 0o755
    assert mode(home / ".local" / "state" / "remote_tpu" / "answered") == 0o600


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


def _call_nothing_at(port: int) -> tuple[float, str]:
    """Call an address where nothing listens: (seconds until it gave up, error)."""
    @remote_tpu.run(accelerator=ACCELERATOR, hosts=f"127.0.0.1:{port}", token=new_token())
    def f():
        return 1

    start = time.monotonic()
    with pytest.raises(remote_tpu.AgentUnavailableError) as info:
        f()
    return time.monotonic() - start, str(info.value)


@pytest.mark.slow
def test_an_address_that_never_answered_fails_in_about_a_second(capsys):
    port = free_port()                   # nothing listens there, nor ever did
    elapsed, error = _call_nothing_at(port)
    assert elapsed < 3, f"gave up after {elapsed:.1f} s"
    assert f"No agent has ever answered this machine at 127.0.0.1:{port}" in error
    assert NOTICE not in capsys.readouterr().err


def test_a_typo_of_local_is_named():
    with pytest.raises(remote_tpu.AgentUnavailableError, match="did you mean hosts='local'"):
        remote_tpu.run(accelerator=ACCELERATOR, hosts="locla", token=new_token())(_answer)()


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
def test_no_agent_at_all_fails_after_bounded_retries(capsys):
    port = free_port()                   # nothing listens there now; one answered before
    from remote_tpu import _answered
    _answered.note(f"127.0.0.1:{port}")
    elapsed, error = _call_nothing_at(port)
    assert f"no remote_tpu agent answered at 127.0.0.1:{port} (UNAVAILABLE" in error
    # 15 s of retries from the first attempt; the last wait is at most 2 s.
    assert 14 <= elapsed <= 25, f"gave up after {elapsed:.1f} s"
    assert capsys.readouterr().err.count(NOTICE) == 1


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


GiB = 1 << 30


def test_upload_deadline_grows_with_the_payload():
    assert upload_deadline(0) == 600
    assert upload_deadline(1 << 20) < 602        # small payloads: the fixed 600 s
    assert upload_deadline(GiB) > upload_deadline(GiB // 2) > upload_deadline(0)
    # the advertised limit (16 GiB) fits at 1 MB/s, not only at 28 MB/s
    assert upload_deadline(16 * GiB) >= 16 * GiB / 1_000_000
    assert 16 * GiB / upload_deadline(16 * GiB) <= 1_000_000


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


def test_ctrl_c_before_the_call_is_sent_is_the_keyboard_interrupt(monkeypatch, capsys):
    """Ctrl-C while the arguments are still being prepared (their buffers
    uploaded): nothing was sent, so nothing is said of the slice."""
    from remote_tpu import _client

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(_client, "_with_blobs", interrupted)
    f = remote_tpu.run(accelerator="tpu-v4-8", hosts=f"127.0.0.1:{free_port()}",
                       token=new_token(), keep_warm=30)(lambda: 1)
    with pytest.raises(KeyboardInterrupt):
        f()
    assert "remote_tpu: job" not in capsys.readouterr().err
