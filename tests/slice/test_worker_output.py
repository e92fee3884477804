"""The worker's Python output is block-buffered and flushed on a timer: a lone
print still arrives while the function runs, a flood arrives whole and in
order, and nothing printed before os._exit, a fork or a failure is lost or
doubled."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from conftest import on_agents, wait_until
from remote_tpu._core.exceptions import JobFailedError

pytestmark = [pytest.mark.timeout(180), pytest.mark.agents(n=1, peers=False)]


class _Seen:
    """The caller's terminal, as the test reads it."""

    def __init__(self) -> None:
        self.text = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_a_lone_print_arrives_while_the_function_still_runs(agents, tmp_path, monkeypatch):
    seen = _Seen()
    monkeypatch.setattr(sys, "stdout", seen)
    go_on = tmp_path / "go-on"

    @on_agents(agents, stream="leader")
    def waits(path):
        import time
        print("waiting for the caller")           # no flush, no newline-flush: the timer
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return os.path.exists(path)

    result: list = []
    caller = threading.Thread(target=lambda: result.append(waits(str(go_on))))
    caller.start()
    try:
        assert wait_until(lambda: "waiting for the caller" in seen.text, timeout=60)
    finally:
        go_on.touch()
        caller.join(90)
    assert result == [True]                   # it saw the line before it was let go


def test_a_flood_on_both_streams_arrives_whole_and_in_order(agents, capfd):
    @on_agents(agents, stream="leader")
    def flood(n):
        for i in range(n):
            sys.stdout.write(f"out {i}\n")
            if i % 10 == 0:
                sys.stderr.write(f"err {i}\n")
        sys.stdout.write("no newline at the end")
        return n

    assert flood(200_000) == 200_000
    out, err = capfd.readouterr()
    lines = out.split("\n")
    assert lines[-1] == "no newline at the end"
    assert lines[:-1] == [f"out {i}" for i in range(200_000)]
    assert [line for line in err.split("\n") if line.startswith("err ")] == \
        [f"err {i}" for i in range(0, 200_000, 10)]


def test_what_was_printed_before_os_exit_is_not_lost(agents):
    @on_agents(agents, stream="leader")
    def leaves():
        print("said before leaving")
        os._exit(3)

    with pytest.raises(JobFailedError) as failed:
        leaves()
    assert "said before leaving" in str(failed.value)
    assert "exited with code 3" in str(failed.value)


def test_a_forked_child_does_not_print_its_parents_buffer_again(agents, capfd):
    @on_agents(agents, stream="leader")
    def forks():
        print("once, from the parent")
        pid = os.fork()
        if pid == 0:
            print("from the child")
            os._exit(0)
        os.waitpid(pid, 0)
        return True

    assert forks() is True
    out = capfd.readouterr().out
    assert out.count("once, from the parent") == 1
    assert "from the child" in out


def test_output_of_a_replaced_stdout_s_original_is_still_flushed(agents, capfd):
    @on_agents(agents, stream="leader")
    def replaces():
        import io
        print("before the swap")          # in our buffer, not flushed yet
        sys.stdout = io.StringIO()        # the user's own: never flushed by us
        return True

    assert replaces() is True
    assert "before the swap" in capfd.readouterr().out


def test_a_print_before_a_failure_is_shown_before_the_error(agents, capfd):
    @on_agents(agents, stream="leader")
    def fails():
        print("the last words")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    assert "the last words" in capfd.readouterr().out


def test_the_worker_s_streams_are_buffered_and_keep_their_encoding(agents):
    @on_agents(agents, stream="none")
    def streams():
        return (sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding,
                sys.stdout is sys.__stdout__, sys.stderr is sys.__stderr__,
                sys.stderr.line_buffering)

    line_buffering, write_through, encoding, same_out, same_err, err_lines = streams()
    assert not line_buffering and not write_through
    assert err_lines                    # stderr: the last words before a crash
    assert encoding.lower().replace("-", "") == "utf8"
    assert same_out and same_err
