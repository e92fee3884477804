"""A real Jupyter kernel (ipykernel, driven by jupyter_client as nbclient
drives it): interrupting a cell that waits on a remote call cancels the job on
every host, raises KeyboardInterrupt in the cell, and the kernel goes on; in a
warm call, the interrupt reaches the function on every host and the warm
workers stay."""

from __future__ import annotations

import queue
import re
import time

import pytest

from conftest import Agents, live_workers, wait_until

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")


def _run_cell(kc, code: str, timeout: float = 90) -> tuple[dict, str]:
    """Run ``code``; its execute_reply content and everything it printed."""
    msg_id = kc.execute(code)
    return _reply(kc, msg_id, timeout)


def _reply(kc, msg_id: str, timeout: float) -> tuple[dict, str]:
    printed = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"the cell printed {''.join(printed)!r} and did not end")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            printed.append(f"{msg['content']['ename']}: {msg['content']['evalue']}\n")
            printed.append(_ANSI.sub("", "\n".join(msg["content"]["traceback"])))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:                  # its own reply (kernel_info replies may come first)
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(printed)


def test_interrupting_a_cell_cancels_the_job_and_the_kernel_goes_on():
    agents = Agents(2)
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        reply, out = _run_cell(kc, f"""
import remote_tpu, time
@remote_tpu.run(accelerator="tpu-v4-16", hosts={agents.addresses[0]!r},
                token={agents.token!r}, init_jax=False)
def step(seconds):
    import os, time
    print("started", flush=True)
    time.sleep(seconds)
    return os.environ["REMOTE_TPU_HOST_INDEX"]
print(step(0))
""")
        assert reply["status"] == "ok" and "started\n0\n" in out, out
        msg_id = kc.execute("step(120)")
        assert wait_until(lambda: len(live_workers()) >= 2, 60), "the job never started"
        time.sleep(0.5)
        interrupted = time.monotonic()
        km.interrupt_kernel()                        # the notebook's stop button: SIGINT
        assert wait_until(lambda: not live_workers(), 10)
        stopped = time.monotonic() - interrupted
        assert stopped < 2.0, f"every host stopped {stopped:.2f} s after the interrupt"
        reply, out = _reply(kc, msg_id, 30)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        reply, out = _run_cell(kc, "print(step(0))")
        assert reply["status"] == "ok" and out.endswith("0\n"), out
        # A silent phase over a second: the status line, in the cell's stderr.
        reply, out = _run_cell(kc, "print(remote_tpu.run(accelerator='tpu-v4-16', "
                                   f"hosts={agents.addresses[0]!r}, token={agents.token!r}, "
                                   "init_jax=False)(time.sleep)(2.5))")
        assert reply["status"] == "ok" and "remote_tpu: 2 processes started; no output yet" \
            in out and "None\n" in out, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        agents.stop()


def test_a_remote_error_shows_the_cells_line_and_no_sdk_frame():
    agents = Agents(2)
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        _run_cell(kc, f"""
import remote_tpu
@remote_tpu.run(accelerator="tpu-v4-16", hosts={agents.addresses[0]!r},
                token={agents.token!r}, init_jax=False)
def step(rows):
    total = rows * 2
    return {{}}[total]            # the typo: a KeyError on every host
""")
        reply, out = _run_cell(kc, "step(21)")
        assert reply["status"] == "error" and reply["ename"] == "KeyError", reply
        # The remote frame: the defining cell by IPython's name, its line and source.
        assert "Cell In[1], line 6, in step" in out, out
        assert "return {}[total]" in out, out
        assert "Cell In[2]" in out and "step(21)" in out, out       # the calling cell
        # Of the SDK, only the frame that raises it again shows (IPython never
        # hides the last frame); none of the hosts' frames.
        assert out.count("remote_tpu/") == 1 and "in RemoteFunction.__call__" in out, out
        assert "worker/child.py" not in out and "agent/" not in out, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        agents.stop()


def test_a_warm_cell_interrupted_once_keeps_its_workers_and_state():
    """The stop button in a cell whose function runs warm: KeyboardInterrupt
    inside the function on every host (its clean-up runs), the cell ends in
    KeyboardInterrupt, and the next cell finds the same workers and state."""
    agents = Agents(2)
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        reply, out = _run_cell(kc, f"""
import remote_tpu, time
@remote_tpu.run(accelerator="tpu-v4-16", hosts={agents.addresses[0]!r},
                token={agents.token!r}, keep_warm=60, stream="all")
def step(seconds):
    import os, time
    remote_tpu.state["n"] = remote_tpu.state.get("n", 0) + 1
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        print("cleaning up", flush=True)
        raise
    return remote_tpu.state["n"], os.getpid()
print(step(0))
""")
        assert reply["status"] == "ok", out
        first_pid = int(out.strip().rsplit(" ", 1)[1].rstrip(")"))
        workers = {p.pid for p in live_workers()}
        msg_id = kc.execute("step(120)")
        time.sleep(1.5)                              # running on both hosts
        km.interrupt_kernel()                        # the stop button: SIGINT
        reply, out = _reply(kc, msg_id, 30)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        assert "warm workers were kept" in reply["evalue"], reply
        assert out.count("cleaning up") == 2, out    # on both hosts
        assert {p.pid for p in live_workers()} == workers
        reply, out = _run_cell(kc, "print(step(0))")
        assert reply["status"] == "ok" and out.strip().endswith(f"(3, {first_pid})"), out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        agents.stop()
