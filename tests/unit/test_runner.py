"""A worker's pipes: each descriptor is closed once, by one caller (a second
close would hit whatever pipe took its number next: another worker's)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from remote_tpu_agent.worker.call import Call
from remote_tpu_agent.worker.run import WorkerRun

pytestmark = pytest.mark.timeout(60)


def _run_with_control_pipe(tmp_path) -> tuple[WorkerRun, int, int]:
    r, w = os.pipe()
    run = WorkerRun(host=0, call=Call(job_dir=str(tmp_path), env={}, payload=b"", digest=""),
                    emit=lambda event: None, forward_output=False)
    run.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    run._control_w = w          # as start() leaves it, without a real worker
    return run, r, w


def test_a_worker_stopped_from_two_threads_closes_its_control_pipe_once(tmp_path,
                                                                        monkeypatch):
    run, r, w = _run_with_control_pipe(tmp_path)
    closes = []
    real_close = os.close

    def slow_close(fd: int) -> None:
        if fd == w:
            closes.append(fd)
            time.sleep(0.2)          # the other stopper comes by meanwhile
        real_close(fd)
    monkeypatch.setattr(os, "close", slow_close)
    stoppers = [threading.Thread(target=run.stop) for _ in range(3)]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(10)
    monkeypatch.undo()
    os.close(r)
    assert closes == [w]
    assert run.proc.poll() is not None


def test_a_write_after_stop_touches_no_descriptor(tmp_path):
    run, r, w = _run_with_control_pipe(tmp_path)
    run.stop()
    other_r, other_w = os.pipe()     # likely takes the control pipe's old number
    try:
        run.release()                # a late release: must not write to other_w
        assert run._send(run.call, {}) is False
        os.set_blocking(other_r, False)
        with pytest.raises(BlockingIOError):
            os.read(other_r, 1)
    finally:
        for fd in (r, other_r, other_w):
            os.close(fd)
