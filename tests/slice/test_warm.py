"""Warm slices (keep_warm): workers that outlive the call, on two real agents
with real multi-process JAX on CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import remote_tpu
import psutil

from conftest import ROOT, Agents, alive, is_idle_spare, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _workers(agents: Agents) -> list[psutil.Process]:
    """The live worker processes of these agents (not of anything else running)."""
    found = []
    for proc in agents.procs:
        try:
            children = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            continue
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE and \
                        "remote_tpu_agent.worker.child" in " ".join(child.cmdline()) and \
                        not is_idle_spare(child):
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
    return found


@pytest.fixture
def slice_(agents):
    """The two agents; every test leaves them with no warm workers."""
    yield agents
    remote_tpu.release(hosts=agents.addresses[0], token=agents.token)
    assert wait_until(lambda: not _workers(agents), timeout=10), \
        f"workers left: {[p.cmdline() for p in _workers(agents)]}"


def _on(agents, **kw):
    kw.setdefault("stream", "none")
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, **kw)


def _count_step():
    """Counts its calls in remote_tpu.state; every host's count and pid come back."""
    import os

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    s = remote_tpu.state
    s["count"] = s.get("count", 0) + 1
    every = multihost_utils.process_allgather(jnp.array([s["count"], os.getpid()]))
    return {"counts": every[:, 0].tolist(), "pids": every[:, 1].tolist()}


def _other_client(agents, body: str, timeout: float = 120) -> subprocess.Popen:
    """Another caller (its own process, so its own client id) of the same slice."""
    code = ("import remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={agents.addresses[0]!r}, "
            f"token={agents.token!r}, stream='none')\n"
            f"def other():\n    {body}\n"
            "print('other returned', other(), flush=True)\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """The other caller's output once it ends (killed if it does not in time)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def test_warm_calls_keep_state_device_arrays_and_processes(slice_):
    @_on(slice_, keep_warm=60)
    def step():
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        s = remote_tpu.state
        s["count"] = s.get("count", 0) + 1
        if "x" not in s:                          # placed on the devices in call 1
            s["x"] = jnp.arange(8.0) * (jax.process_index() + 1)
            s["where"] = (id(s["x"]), s["x"].unsafe_buffer_pointer())
        x = s["x"]
        same = (id(x), x.unsafe_buffer_pointer()) == s["where"] and not x.is_deleted()
        total = jax.jit(lambda v: v.sum())(x)
        every = multihost_utils.process_allgather(
            jnp.array([s["count"], int(same), os.getpid(), int(total)]))
        return every.tolist()

    import os
    results = [step() for _ in range(3)]
    for call, rows in enumerate(results, start=1):
        assert [r[0] for r in rows] == [call, call]          # every host counted
        assert [r[1] for r in rows] == [1, 1]                # the same array, unmoved
        assert [r[3] for r in rows] == [28, 56]              # host-specific data
    assert len({tuple(r[2] for r in rows) for rows in results}) == 1   # same processes
    assert len(_workers(slice_)) == 2          # parked, still there after the call


def test_other_options_replace_the_warm_workers_and_say_so(slice_, capfd):
    first = _on(slice_, keep_warm=60, env={"FLAVOUR": "a"})(_count_step)
    second = _on(slice_, keep_warm=60, env={"FLAVOUR": "b"})(_count_step)
    a1, a2 = first(), first()
    assert a2["counts"] == [2, 2] and a2["pids"] == a1["pids"]
    capfd.readouterr()
    b = second()
    assert b["counts"] == [1, 1]                     # fresh workers, empty state
    assert not set(b["pids"]) & set(a1["pids"])
    err = capfd.readouterr().err
    assert "remote_tpu: the warm workers of warm-" in err and "were replaced" in err
    assert "env differs" in err


def test_release_ends_every_worker_and_the_next_call_starts_fresh(slice_):
    step = _on(slice_, keep_warm=60)(_count_step)
    pids = step()["pids"]
    assert {p.pid for p in _workers(slice_)} == set(pids)
    assert step.release() is True
    assert wait_until(lambda: not _workers(slice_), timeout=10)
    assert step.release() is False                  # nothing left to release
    cli = subprocess.run([sys.executable, "-m", "remote_tpu", "release", "--hosts",
                          slice_.addresses[0]], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "REMOTE_TPU_TOKEN": slice_.token})
    assert cli.returncode == 0 and "no warm workers" in cli.stdout, cli.stderr
    again = step()
    assert again["counts"] == [1, 1] and not set(again["pids"]) & set(pids)


def test_idle_time_ends_the_workers_and_the_listing_shows_the_session(slice_):
    step = _on(slice_, keep_warm=3)(_count_step)
    step()
    warm = [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
            if j.state == "WARM"]
    assert len(warm) == 1 and warm[0].id.startswith("warm-")
    assert time.time() < warm[0].warm_until <= time.time() + 3.5
    cli = subprocess.run([sys.executable, "-m", "remote_tpu", "jobs", "list", "--hosts",
                          slice_.addresses[0]], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "REMOTE_TPU_TOKEN": slice_.token})
    assert f"{warm[0].id}" in cli.stdout and "WARM" in cli.stdout and "idle until" in cli.stdout
    assert wait_until(lambda: not _workers(slice_), timeout=15)
    session = remote_tpu.attach(warm[0].id, hosts=slice_.addresses[0], token=slice_.token)
    assert wait_until(lambda: session.status().state == "SUCCEEDED", timeout=10)
    assert "idle" in session.status().detail


def _failing_step(agents):
    """Counts its calls in remote_tpu.state on every host; ``raise_on`` hosts
    raise, ``block_on`` hosts wait in a collective (for the ones that raised:
    they never come), the others return."""
    @_on(agents, keep_warm=60)
    def step(raise_on=(), block_on=()):
        import os

        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        s = remote_tpu.state
        s["count"] = s.get("count", 0) + 1
        me = jax.process_index()
        if me in raise_on:
            raise ValueError(f"bad batch on host {me}")
        if me in block_on:
            multihost_utils.sync_global_devices("never reached by the host that raised")
        if raise_on:                # (no collective with the hosts that raise)
            return s["count"]
        every = multihost_utils.process_allgather(jnp.array([s["count"], os.getpid()]))
        return {"counts": every[:, 0].tolist(), "pids": every[:, 1].tolist()}
    return step


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("raise_on", [(1,), (0, 1)], ids=["one-host", "every-host"])
def test_an_exception_keeps_the_warm_workers_and_state(slice_, raise_on):
    step = _failing_step(slice_)
    first = step()
    assert first["counts"] == [1, 1]
    with pytest.raises(ValueError, match="bad batch") as info:
        step(raise_on=raise_on)
    notes = _notes(info.value)
    assert any(f"raised on host {h} of 2" in notes for h in raise_on), notes  # (the first)
    assert "warm workers were kept" in notes and "remote_tpu.state" in notes, notes
    assert "stopped" not in notes, notes
    after = step()                       # the same processes, the state as it was left
    assert after == {"counts": [3, 3], "pids": first["pids"]}, (after, first)


def test_an_exception_while_another_host_blocks_ends_the_workers_in_time(slice_):
    step = _failing_step(slice_)
    first = step()
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on host 1") as info:
        step(raise_on=(1,), block_on=(0,))
    took = time.monotonic() - started
    notes = _notes(info.value)
    assert "raised on host 1 of 2" in notes, notes
    assert "warm workers were stopped" in notes and "remote_tpu.state" in notes, notes
    assert took < 5, took             # fail-fast (the figure: benchmarks/fail_fast.py)
    assert wait_until(lambda: not _workers(slice_), timeout=10)
    after = step()
    assert after["counts"] == [1, 1] and set(after["pids"]).isdisjoint(first["pids"])


def test_a_cancelled_warm_call_ends_the_workers_and_says_so(slice_):
    @_on(slice_, keep_warm=60)
    def step(sleep: float):
        import time

        time.sleep(sleep)
        return os.getpid()

    import os
    step(0)
    handle = step.submit(300)                        # this caller's: runs warm
    assert wait_until(lambda: handle.status().state == "RUNNING", timeout=30)
    handle.cancel()
    assert wait_until(lambda: not _workers(slice_), timeout=5)
    with pytest.raises(remote_tpu.JobFailedError, match="warm workers were stopped"):
        handle.result(timeout=30)


def test_another_callers_job_waits_for_the_release(slice_):
    step = _on(slice_, keep_warm=120)(_count_step)
    step()
    other = _other_client(slice_, "return 'ran'")
    try:
        assert wait_until(lambda: any(j.state == "QUEUED" for j in remote_tpu.jobs(
            hosts=slice_.addresses[0], token=slice_.token)), timeout=60)
        time.sleep(1)
        assert other.poll() is None                  # still waiting behind the session
        assert step()["counts"] == [2, 2]            # the owner's calls go first
        assert remote_tpu.release(hosts=slice_.addresses[0], token=slice_.token) is True
    finally:
        out, err = _finish(other)
    assert other.returncode == 0, err
    assert "other returned ran" in out
    assert "queued behind the warm workers of warm-" in err


def test_another_callers_job_runs_after_the_idle_time(slice_):
    step = _on(slice_, keep_warm=4)(_count_step)
    step()
    other = _other_client(slice_, "return 'ran'")
    out, err = _finish(other)
    assert other.returncode == 0, err
    assert "other returned ran" in out


def test_keep_warm_is_checked_when_decorating(monkeypatch):
    with pytest.raises(remote_tpu.ConfigurationError, match="keep_warm must be"):
        remote_tpu.run(accelerator="tpu-v4-16", keep_warm=-1)
    with pytest.raises(remote_tpu.ConfigurationError, match="keep_warm must be"):
        remote_tpu.run(accelerator="tpu-v4-16", keep_warm="60")
    monkeypatch.setenv("REMOTE_TPU_KEEP_WARM", "soon")
    with pytest.raises(remote_tpu.ConfigurationError, match="REMOTE_TPU_KEEP_WARM"):
        remote_tpu.run(accelerator="tpu-v4-16")
    monkeypatch.setenv("REMOTE_TPU_KEEP_WARM", "30")
    assert remote_tpu.run(accelerator="tpu-v4-16")(lambda: 0).options.keep_warm == 30.0
    assert remote_tpu.run(accelerator="tpu-v4-16", keep_warm=0)(
        lambda: 0).options.keep_warm == 0.0


def _interruptible(head: str, call: str, then: str = "", args: tuple = ()) -> subprocess.Popen:
    """A caller that runs ``head``, prints 'calling', makes ``call``, prints
    'interrupted' on Ctrl-C, then runs ``then`` (``args``: its sys.argv[1:])."""
    code = (f"{head}try:\n    print('calling', flush=True)\n    {call}\n"
            f"except KeyboardInterrupt as e:\n    print('interrupted', flush=True)\n"
            f"    print('KeyboardInterrupt:', e, file=__import__('sys').stderr)\n{then}")
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ctrl_c_caller(agents, on_interrupt: str, marks) -> subprocess.Popen:
    """A caller whose warm ``step(sleep)`` counts its calls in remote_tpu.state,
    sleeps, and on KeyboardInterrupt writes ``cleaned-<host>`` in its working
    directory, then runs ``on_interrupt`` (indented code, e.g. ``raise``)."""
    code = ("import os, sys, time, remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={agents.addresses[0]!r}, "
            f"token={agents.token!r}, stream='none', keep_warm=60)\n"
            "def step(sleep, mark=''):\n"
            "    import jax\n"
            "    remote_tpu.state['n'] = remote_tpu.state.get('n', 0) + 1\n"
            "    try:\n"
            "        time.sleep(sleep)\n"
            "    except KeyboardInterrupt:\n"
            "        open(os.path.join(mark, f'cleaned-{jax.process_index()}'), 'w').close()\n"
            f"{on_interrupt}\n"
            "    return remote_tpu.state['n'], os.getpid()\n"
            "print('first', *step(0), flush=True)\n")
    return _interruptible(code, "step(300, sys.argv[1])", then=(
        "print('next', *step(0), flush=True)\n"), args=(str(marks),))


def _ctrl_c(proc: subprocess.Popen) -> None:
    proc.send_signal(__import__("signal").SIGINT)


def test_the_first_ctrl_c_interrupts_every_host_and_keeps_the_warm_workers(slice_, tmp_path):
    proc = _ctrl_c_caller(slice_, "        raise", tmp_path)
    try:
        first = proc.stdout.readline().split()
        assert first[:2] == ["first", "1"], first
        workers = {w.pid for w in _workers(slice_)}
        assert len(workers) == 2
        assert proc.stdout.readline().strip() == "calling"
        time.sleep(1)                        # the call is running on both hosts
        _ctrl_c(proc)
        assert proc.stdout.readline().strip() == "interrupted"
        # every host ran its clean-up, and the same workers take the next call
        assert sorted(os.listdir(tmp_path)) == ["cleaned-0", "cleaned-1"]
        assert proc.stdout.readline().split() == ["next", "3", first[2]]
        assert {w.pid for w in _workers(slice_)} == workers
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 0, err
    assert "interrupting job" in err and "KeyboardInterrupt in the function" in err, err
    assert "were stopped" not in err, err


def test_a_second_ctrl_c_stops_every_host_and_the_next_call_starts_fresh(slice_, tmp_path):
    proc = _ctrl_c_caller(slice_, "        time.sleep(300)", tmp_path)   # (clean-up hangs)
    try:
        assert proc.stdout.readline().split()[:2] == ["first", "1"]
        workers = _workers(slice_)
        assert proc.stdout.readline().strip() == "calling"
        time.sleep(1)
        _ctrl_c(proc)
        assert wait_until(lambda: len(os.listdir(tmp_path)) == 2, timeout=10)
        started = time.monotonic()
        _ctrl_c(proc)
        assert proc.stdout.readline().strip() == "interrupted"
        assert wait_until(lambda: not any(map(alive, workers)), timeout=5)
        assert time.monotonic() - started < 5
        assert proc.stdout.readline().split()[:2] == ["next", "1"]   # fresh, empty state
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 0, err
    assert "was cancelled on every host; the warm workers were stopped with it" in err, err


def test_a_host_not_back_in_time_after_ctrl_c_ends_the_warm_workers(slice_, tmp_path):
    proc = _ctrl_c_caller(slice_, "        if jax.process_index() == 1:\n"
                                  "            time.sleep(300)\n"
                                  "        raise", tmp_path)
    try:
        assert proc.stdout.readline().split()[:2] == ["first", "1"]
        workers = _workers(slice_)
        assert proc.stdout.readline().strip() == "calling"
        time.sleep(1)
        started = time.monotonic()
        _ctrl_c(proc)
        assert proc.stdout.readline().strip() == "interrupted"
        assert 4 < time.monotonic() - started < 12          # INTERRUPT_SECONDS, then the stop
        assert wait_until(lambda: not any(map(alive, workers)), timeout=5)
        assert proc.stdout.readline().split()[:2] == ["next", "1"]
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 0, err
    assert "host 1 did not come back to rest within 5 s" in err, err
    assert "warm workers were stopped" in err, err


def test_ctrl_c_before_the_gateway_answers_does_not_say_the_warm_workers_stopped():
    """A gateway that takes the connection and says nothing (a stuck VM): had
    the call reached it, it was cancelled; that cannot be known, and is said so."""
    from remote_tpu._core.auth import new_token

    mute = socket.create_server(("127.0.0.1", 0))
    code = ("import remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v4-16', hosts='127.0.0.1:{mute.getsockname()[1]}',"
            f" token={new_token()!r}, keep_warm=60)\n"
            "def f():\n"
            "    return 1\n")
    proc = _interruptible(code, "f()")
    try:
        assert proc.stdout.readline().strip() == "calling"
        time.sleep(1.5)
        proc.send_signal(__import__("signal").SIGINT)
        assert proc.stdout.readline().strip() == "interrupted"
    finally:
        out, err = _finish(proc, timeout=30)
        mute.close()
    assert "interrupted before the slice answered" in err, err
    assert "was cancelled on every host; the warm workers were stopped" not in err, err


def test_release_during_a_warm_call_lets_it_finish_then_ends_the_workers(slice_):
    @_on(slice_, keep_warm=60)
    def step(sleep: float):
        import time

        time.sleep(sleep)
        return "finished"

    step(0)
    handle = step.submit(3)                          # this caller's: runs warm
    assert wait_until(lambda: handle.status().state == "RUNNING", timeout=30)
    assert remote_tpu.release(hosts=slice_.addresses[0], token=slice_.token) is True
    assert handle.result(timeout=60) == "finished"   # not cut short
    assert wait_until(lambda: not _workers(slice_), timeout=10)


def test_a_warm_calls_stacks_show_every_host_and_its_session_has_no_value(slice_):
    @_on(slice_, keep_warm=60)
    def nap(sleep: float):
        import time

        time.sleep(sleep)

    nap(0)
    handle = nap.submit(60)
    assert wait_until(lambda: handle.status().state == "RUNNING", timeout=30)
    stacks = {}

    def both_in_nap() -> bool:
        stacks.clear()
        stacks.update(handle.stacks())
        return len(stacks) == 2 and all("in nap" in text for text in stacks.values())
    assert wait_until(both_in_nap, timeout=10, interval=0.2), stacks
    assert sorted(stacks) == [0, 1]
    assert all("in nap" in text for text in stacks.values()), stacks
    handle.cancel()
    session = [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
               if j.id.startswith("warm-")][0]
    ended = remote_tpu.attach(session.id, hosts=slice_.addresses[0], token=slice_.token)
    assert wait_until(lambda: ended.status().finished, timeout=10)
    with pytest.raises(remote_tpu.RemoteTPUError, match="warm session's entry"):
        ended.result(timeout=10)


def test_state_named_from_the_callers_module_is_the_workers_own(slice_):
    """``from remote_tpu import state`` at the top of a script: the function
    finds the worker's dict, not a copy of the caller's (it pickles by reference)."""
    code = ("import remote_tpu\n"
            "from remote_tpu import state\n"
            "state['caller'] = 'only here'\n"
            f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={slice_.addresses[0]!r}, "
            f"token={slice_.token!r}, stream='none', keep_warm=60)\n"
            "def step():\n"
            "    state['n'] = state.get('n', 0) + 1\n"
            "    return state['n'], 'caller' in state, state is remote_tpu.state\n"
            "print(step(), step(), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(1, False, True) (2, False, True)"


def test_a_peer_worker_killed_between_calls_ends_the_session_and_says_so(slice_, capfd):
    step = _on(slice_, keep_warm=60)(_count_step)
    pids = step()["pids"]
    os.kill(pids[1], __import__("signal").SIGKILL)      # host 1's parked worker
    # Noticed between calls: the session ends (not at the next call's expense).
    assert wait_until(lambda: not [j for j in remote_tpu.jobs(
        hosts=slice_.addresses[0], token=slice_.token) if j.state == "WARM"], timeout=10)
    again = step()                                      # fresh workers, not an error
    assert again["counts"] == [1, 1] and not set(again["pids"]) & set(pids)
    err = capfd.readouterr().err
    assert "warm workers of warm-" in err and "remote_tpu.state started empty" in err


def test_a_live_sessions_entry_says_at_once_it_has_no_value(slice_):
    step = _on(slice_, keep_warm=60)(_count_step)
    step()
    session = [j for j in remote_tpu.jobs(hosts=slice_.addresses[0], token=slice_.token)
               if j.state == "WARM"][0]
    handle = remote_tpu.attach(session.id, hosts=slice_.addresses[0], token=slice_.token)
    start = time.monotonic()
    with pytest.raises(remote_tpu.ConfigurationError, match="warm session's entry"):
        handle.result()
    assert time.monotonic() - start < 30             # not after the session's 60 s


def test_output_between_calls_is_kept(slice_):
    @_on(slice_, keep_warm=60, stream="leader")
    def chatty(text: str):
        import sys
        import threading
        import time

        def later():
            time.sleep(0.3)
            print("printed between calls", flush=True)
        if text == "start":
            threading.Thread(target=later, daemon=True).start()
        sys.stdout.write(text)
        sys.stdout.flush()

    chatty("start")
    time.sleep(1)
    handle = chatty.submit("a [")                     # ends with what could start a Gloo line
    handle.result(timeout=60)
    assert handle.logs() == "printed between calls\na ["


def test_a_warm_calls_output_reaches_its_caller_while_it_runs(slice_, tmp_path):
    """A session's next call runs in the thread that received it on the
    gateway, and each peer sends its events on its lane from the thread that
    read them: output must still reach the caller live, from every host."""
    warmup, marker = tmp_path / "warmup", tmp_path / "marker"
    warmup.touch()
    code = ("import remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v4-16', hosts={slice_.addresses[0]!r}, "
            f"token={slice_.token!r}, keep_warm=60, stream='all')\n"
            "def wait_for(path):\n"
            "    import os, time, jax\n"
            "    print('before', jax.process_index(), flush=True)\n"
            "    deadline = time.time() + 60\n"
            "    while not os.path.exists(path) and time.time() < deadline:\n"
            "        time.sleep(0.05)\n"
            "    return os.path.exists(path)\n"
            f"wait_for({str(warmup)!r})\n"
            "print('warm', flush=True)\n"
            f"print('result', wait_for({str(marker)!r}), flush=True)\n"
            "wait_for.release()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        seen, warm = [], False
        while not (warm and any("before 0" in line for line in seen)
                   and any("before 1" in line for line in seen)):
            line = proc.stdout.readline()
            assert line, f"the caller ended first: {seen}"
            warm = warm or line.startswith("warm")
            if warm:
                seen.append(line)
        marker.touch()                     # only now may the warm call return
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "result True" in rest, seen + [rest]


def test_a_warm_call_whose_caller_stops_reading_still_times_out(tmp_path):
    """A warm call that starts in the thread serving its caller must not wait
    for that caller to read: with the caller's own stdout full (nobody reads
    it), its `timeout=` still ends the job on time. On gRPC (no data port, so
    no lane, whose keepalive would take such a caller as gone)."""
    agent = Agents(1, extra=["--data-port", "-1"])
    warm = tmp_path / "warm"
    code = ("import pathlib, remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v4-8', hosts={agent.addresses[0]!r}, "
            f"token={agent.token!r}, keep_warm=60, stream='all', timeout=4)\n"
            "def flood(lines):\n"
            "    import sys, time\n"
            "    for _ in range(lines):\n"
            "        sys.stdout.write('x' * 1023 + '\\n')\n"
            "    sys.stdout.flush()\n"
            "    time.sleep(60 if lines else 0)\n"
            "flood(0)\n"
            f"pathlib.Path({str(warm)!r}).touch()\n"
            "flood(40_000)\n")                     # 40 MB, to a stdout nobody reads
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(warm.exists, timeout=120), "the first call did not end"

        def second():
            return [j for j in remote_tpu.jobs(hosts=agent.addresses[0], token=agent.token)
                    if j.id.startswith("flood-")][0]
        assert wait_until(lambda: second().finished, timeout=40), second()
        assert second().state == "TIMED_OUT", second().detail
    finally:
        proc.kill()
        proc.wait()
        agent.stop()
