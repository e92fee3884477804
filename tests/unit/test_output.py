"""Gloo's start-up noise never reaches the user; partial lines and bytes are kept."""

import io
import sys

import pytest

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._render import OutputRenderer
from remote_tpu_agent.worker.output_filter import NoiseFilter, Tail

# As seen from 2 processes x 4 CPU devices: one thread per device prints at once.
INTERLEAVED = (
    b"[Gloo] Rank 1 is connected to [Gloo] Rank 72 peer ranks.  is connected to Expected "
    b"number of connected peer ranks is : 77\n peer ranks. Expected number of connected peer"
    b" ranks is : 7\n"
    b"[Gloo] Rank 0[Gloo] Rank  is connected to 1 is connected to 77 peer ranks.  peer ranks"
    b". Expected number of connected peer ranks is : Expected number of connected peer ranks"
    b" is : 77\n\n"
)


@pytest.mark.parametrize("step", [1, 2, 5, 64, 10_000])
def test_interleaved_gloo_noise_is_dropped_whatever_the_chunking(step):
    user = b"step 1\n42\n\n[not gloo] x\nExpected number: 3\n"
    stream = b"hello\n" + INTERLEAVED + user + b"partial"
    f = NoiseFilter()
    out = b"".join(f.feed(stream[i:i + step]) for i in range(0, len(stream), step))
    out += f.flush()
    assert out == b"hello\n" + user + b"partial"


@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_gloo_message_inside_a_user_line_is_cut_out(step):
    # A Python print writes "ok" and "\n" separately; a C thread's Gloo message
    # can land between them (its own newline is indistinguishable from the user's).
    message = (b"[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of "
               b"connected peer ranks is : 3")
    stream = b"ok" + message + b"\n\n" + b"progress [===>  ]\r" + b"next line\n"
    f = NoiseFilter()
    shown = [f.feed(stream[i:i + step]) for i in range(0, len(stream), step)]
    assert b"".join(shown) + f.flush() == b"ok\nprogress [===>  ]\rnext line\n"
    assert shown[0].startswith(b"o")          # the user's partial line is not held back


def test_plain_gloo_line_dropped_and_partial_user_line_passes_at_once():
    f = NoiseFilter()
    assert f.feed(b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
                  b"connected peer ranks is : 1\n") == b""
    assert f.feed(b"progress: 10%") == b"progress: 10%"     # no newline yet: shown now
    assert f.feed(b" 20%\n") == b" 20%\n"


def test_tail_keeps_last_lines():
    t = Tail(3)
    t.feed(b"a\nb\nc\nd\ne")
    assert t.lines() == ["c", "d", "e"]


def test_renderer_prefixes_lines_per_host_and_keeps_split_utf8(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    r = OutputRenderer("all")
    snow = "☃".encode()
    r.write(0, pb.OUTPUT_STREAM_STDOUT, b"one\ntw")
    r.write(1, pb.OUTPUT_STREAM_STDOUT, b"x" + snow[:1])
    r.write(0, pb.OUTPUT_STREAM_STDOUT, b"o\n")
    r.write(1, pb.OUTPUT_STREAM_STDOUT, snow[1:] + b"\n")
    r.write(1, pb.OUTPUT_STREAM_STDOUT, b"no newline at the end")
    assert out.getvalue() == "[host 0] one\n[host 0] two\n[host 1] x☃\n"
    r.close()
    assert out.getvalue().endswith("[host 1] x☃\n[host 1] no newline at the end")


def test_renderer_leader_passes_partial_lines_at_once(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    r = OutputRenderer("leader")
    r.write(0, pb.OUTPUT_STREAM_STDOUT, b"progress 10%")
    assert out.getvalue() == "progress 10%"


def test_renderer_none_shows_nothing(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    OutputRenderer("none").write(0, pb.OUTPUT_STREAM_STDOUT, b"hidden\n")
    assert out.getvalue() == ""
