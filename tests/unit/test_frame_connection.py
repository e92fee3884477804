"""The one connection kind of every link and lane
(remote_tpu/_core/frame_connection.py), on a socket pair. Its roles on real data
ports: test_peer_link.py, test_lane.py; between agents: tests/slice."""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from remote_tpu._core import data_wire
from remote_tpu._core.frame_connection import FrameConnection

pytestmark = pytest.mark.timeout(60)

CALL, EVENT, END = data_wire.CALL, data_wire.EVENT, data_wire.END


def _pair(served: bool = True) -> tuple[FrameConnection, FrameConnection]:
    a, b = socket.socketpair()
    return (FrameConnection(a, (EVENT, END), what="link", served=served),
            FrameConnection(b, (CALL,), what="link", closed_why="the gateway left"))


def _serving(conn: FrameConnection, frames: queue.Queue, **kw) -> threading.Thread:
    thread = threading.Thread(target=conn.serve, args=(
        lambda kind, call_id, body: frames.put((kind, call_id, body)),), kwargs=kw,
        daemon=True)
    thread.start()
    return thread


def test_numbered_frames_cross_each_under_its_call_id():
    gateway, peer = _pair(served=False)
    frames: queue.Queue = queue.Queue()
    reader = _serving(peer, frames)
    ids = [gateway.new_id() for _ in range(3)]
    assert ids == [1, 2, 3]
    for call_id in ids:
        gateway.send(CALL, call_id, f"call {call_id}".encode())
    assert [frames.get(timeout=5) for _ in ids] == [(CALL, i, f"call {i}".encode())
                                                    for i in ids]
    peer.send(EVENT, 2, b"for two")
    peer.send(END, 2)
    assert gateway.read() == (EVENT, 2, b"for two") and gateway.read() == (END, 2, b"")
    gateway.close()                            # no reader of its own: closed at once
    reader.join(5)
    assert peer.why == "the gateway left" and not peer.broken and peer.closed
    assert not peer.try_send(EVENT, 1)


@pytest.mark.parametrize("frame, said", [
    ((5).to_bytes(4, "big") + bytes((EVENT,)) + bytes(4), "unknown link frame kind"),
    ((2).to_bytes(4, "big") + bytes((CALL,)) + b"\x00", "carries no call id"),
])
def test_a_frame_its_role_cannot_take_breaks_it_and_says_why(frame, said):
    gateway, peer = _pair()
    ended: list[bool] = []
    reader = _serving(peer, queue.Queue(), ending=lambda: ended.append(peer.sock.fileno() >= 0))
    gateway.sock.sendall(frame)
    reader.join(5)
    assert peer.broken and peer.why.startswith("the link broke: ") and said in peer.why
    assert ended == [True]                     # told before the connection closed
    assert gateway.read() is None              # and the other end sees it closed


def test_closing_a_served_end_leaves_the_closing_to_its_reader():
    gateway, peer = _pair()
    frames: queue.Queue = queue.Queue()
    reader = _serving(gateway, frames)
    gateway.close()
    reader.join(5)
    assert gateway.ours and gateway.closed and not gateway.broken
    assert gateway.sock.fileno() == -1         # closed by its reader, at its end
    assert not gateway.try_send(CALL, 1)
    peer.close()
