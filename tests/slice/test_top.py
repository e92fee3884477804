"""Live per-host metrics (remote-tpu top, handle.metrics()): on four real
agents, a function that reports its steps; top on a pseudo-terminal and in
--json shows every host and the step rate."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import ROOT, on_agents, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.agents(n=4)]


def _steps(seconds):
    import time

    import remote_tpu
    step, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)                     # about 20 steps a second
        step += 1
        remote_tpu.progress(step=step)
    return step


def _top(agents, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_tpu", "top", *args,
                           "--hosts", agents.addresses[0]], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ,
                                                     "REMOTE_TPU_TOKEN": agents.token}, **kw)


def _on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``argv`` with its stdout and stderr on a pseudo-terminal of 160
    columns: its exit status and all it wrote."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child,
                            cwd=ROOT, env=env)
    os.close(child)
    seen = b""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        try:
            chunk = os.read(main, 65536) if ready else b""
        except OSError:                            # the terminal's other end closed
            chunk = b""
        if not chunk and (ready or proc.poll() is not None):
            break
        seen += chunk
    proc.wait(30)
    os.close(main)
    return proc.returncode, seen.decode(errors="replace")


def _running(agents, seconds: float):
    handle = on_agents(agents, "tpu-v4-32")(_steps).submit(seconds)
    assert wait_until(lambda: len([m for m in handle.metrics()
                                   if m["step"] and m["steps_per_second"] > 0]) == 4,
                      timeout=60), handle.metrics()
    return handle


def test_top_json_and_handle_metrics_show_every_host_and_its_step_rate(agents):
    handle = _running(agents, 8)
    shown = _top(agents, "--json")               # no job id: the slice's running job
    assert shown.returncode == 0, shown.stderr
    metrics = json.loads(shown.stdout)
    assert [m["host"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:
        assert m["state"] == "running" and m["step"] > 0, m
        assert 2 < m["steps_per_second"] < 40, m         # about 20, less on a busy machine
        assert m["rss_bytes"] > 10 << 20, m
        assert m["tpu"]["note"] == "no TPU on this host", m
    assert handle.result() > 0
    assert handle.metrics() == []                  # over: no live metrics
    ended = _top(agents, handle.id, "--once")
    assert ended.returncode == 0 and "(no metrics: the job is not running)" in ended.stdout


def test_top_on_a_terminal_refreshes_every_host_until_the_job_ends(agents):
    handle = _running(agents, 4)
    returncode, text = _on_a_terminal([sys.executable, "-m", "remote_tpu", "top", handle.id,
                                       "--interval", "0.5", "--hosts", agents.addresses[0]],
                                      {**os.environ, "REMOTE_TPU_TOKEN": agents.token})
    assert returncode == 0, text
    screens = text.split("\x1b[H\x1b[2J")
    assert len(screens) >= 3, text                  # refreshed while it ran
    live = next(s for s in screens if "steps/s, slowest host" in s)
    assert "HOST  STATE" in live
    for h in range(4):
        assert f"\r\n{h}     running" in live or f"\n{h}     running" in live, live
    assert "SUCCEEDED" in screens[-1]                # and it stopped once the job ended


def test_an_attached_calls_status_line_shows_the_steps_and_the_slowest_host(agents, tmp_path):
    """A call on a terminal whose function reports steps and prints nothing:
    its live status line says where the job is."""
    script = tmp_path / "steps.py"
    script.write_text(
        "import remote_tpu, time\n"
        f"@remote_tpu.run(accelerator='tpu-v4-32', hosts={agents.addresses[0]!r}, "
        f"token={agents.token!r})\n"
        "def steps():\n"
        "    import jax, time, remote_tpu\n"
        "    pause = 0.2 if jax.process_index() == 2 else 0.05\n"
        "    for step in range(1, 10**9):\n"
        "        time.sleep(pause)\n"
        "        remote_tpu.progress(step=step)\n"
        "        if step * pause > 6:\n"
        "            return step\n"
        "print('returned', steps())\n")
    returncode, text = _on_a_terminal([sys.executable, str(script)], dict(os.environ))
    assert returncode == 0 and "returned" in text, text
    assert "remote_tpu: running: step " in text and "steps/s, slowest host 2" in text, text


def test_the_merged_log_of_four_hosts_printing_at_once_keeps_each_hosts_order(agents):
    """Four hosts print interleaved lines as fast as they can: the merged log
    (handle.logs(host="all")) has every line, each host's in its own order."""
    def chatter():
        import os
        import time
        i = int(os.environ["REMOTE_TPU_HOST_INDEX"])
        for n in range(300):
            print(f"host {i} line {n}", flush=n % 7 == 0)
            if n % 50 == 0:
                time.sleep(0.02)
    handle = on_agents(agents, "tpu-v4-32", stream="none")(chatter).submit()
    handle.result()
    merged = handle.logs(host="all").splitlines()
    assert len(merged) == 4 * 300
    for h in range(4):
        mine = [line for line in merged if line.startswith(f"[host {h}] ")]
        assert mine == [f"[host {h}] host {h} line {n}" for n in range(300)]
    hosts_in_order = [line.split("]")[0] for line in merged]
    switches = sum(a != b for a, b in zip(hosts_in_order, hosts_in_order[1:]))
    assert switches >= 4, "the hosts' lines were not merged, only put one after another"
