"""The live status line: on a terminal (a real pseudo-terminal here) a call's
long phases show on one line that is erased before the function's output;
through a pipe nothing of it appears."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import termios
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_CODE = """
import remote_tpu
@remote_tpu.run(accelerator="tpu-v4-16", hosts={hosts!r}, token={token!r})
def quiet_then_hello():
    import time
    time.sleep(2.5)                       # a silent phase the status covers
    print("hello from the slice", flush=True)
    return 7
print("value", quiet_then_hello(), flush=True)
"""


def _on_a_terminal(code: str) -> str:
    """Run ``code`` with its stdout and stderr on a pseudo-terminal; all it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL, cwd=ROOT)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:                   # the terminal closed: the process is gone
            break
        if not chunk:
            break
        out += chunk
    proc.wait(30)
    os.close(master)
    return out.decode(errors="replace")


def test_a_terminal_shows_the_phase_and_erases_it_before_the_output(agents):
    code = _CODE.format(hosts=agents.addresses[0], token=agents.token)
    out = _on_a_terminal(code)
    assert "remote_tpu: 2 processes started, initializing JAX; no output yet [" in out, out
    status_at = out.index("no output yet")
    hello_at = out.index("hello from the slice")
    assert status_at < hello_at and "value 7" in out
    # Erased before the function's line: the line it took is cleared (\r, then
    # blanks or an erase sequence) between the status and the output.
    between = out[status_at:hello_at]
    assert "\r" in between, repr(between)


def test_a_pipe_shows_no_status(agents):
    code = _CODE.format(hosts=agents.addresses[0], token=agents.token)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from the slice\nvalue 7\n"
    assert "no output yet" not in done.stderr and "\r" not in done.stderr
