"""The agent <-> worker pipe frames (``agent/worker/frames.py``) at their edges:
a blob of 0 and 1 bytes, exactly the size sent in one write with its header,
one byte past it, far past the pipe's buffer, a 2 MB header; a pipe that ends
mid-frame."""

from __future__ import annotations

import os
import threading

import pytest

from remote_tpu_agent.worker import frames as wire

JOINED = wire._JOINED_BYTES


def _round_trip(frames: list[tuple[bytes, dict, bytes]]) -> list:
    r, w = os.pipe()

    def write() -> None:                     # (a writer blocks on a full pipe)
        for kind, header, blob in frames:
            wire.write_frame(w, kind, header, blob)
        os.close(w)
    writer = threading.Thread(target=write)
    writer.start()
    got = []
    while (frame := wire.read_frame(r)) is not None:
        got.append(frame)
    writer.join(30)
    os.close(r)
    return got


@pytest.mark.timeout(60)
def test_frames_of_every_size_arrive_whole_and_in_order():
    sizes = [0, 1, JOINED - 1, JOINED, JOINED + 1, 3 << 20]
    frames = [(wire.CALL if i % 2 else wire.DONE, {"i": i, "size": size},
               bytes([i % 251]) * size) for i, size in enumerate(sizes)]
    frames.append((wire.DONE, {"exception": "x" * (2 << 20)}, b"value"))   # a 2 MB message
    frames.append((wire.RELEASE, {}, b""))
    assert _round_trip(frames) == frames


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", [0, 1, 5, 9, 20, -1])
def test_a_pipe_that_ends_mid_frame_reads_as_its_end(cut):
    """Whatever part of a frame came before the pipe ended, no frame is made of it."""
    r, w = os.pipe()
    wire.write_frame(w, wire.DONE, {"state": "succeeded"}, b"v" * 50)
    whole = os.read(r, 1 << 16)
    os.close(w)
    os.close(r)
    r, w = os.pipe()
    assert len(whole) > 40
    os.write(w, whole[:cut])                # (-1: all but its last byte)
    os.close(w)
    try:
        assert wire.read_frame(r) is None
    finally:
        os.close(r)
