"""One host's output of one job, on disk: framed records, bounded, never half-written.

Offsets count bytes of the framed stream from the job's start and never move.
Up to ``max_bytes`` are kept: the first half in ``host-N.log``, then tail
segments ``host-N.log.OFFSET`` of an eighth each, the oldest dropped once there
are more than four. No file holds more than its share: a record that does not
fit what is left of one goes whole to the next, and one larger than a whole
file is split to fill each. A reader whose offset falls in what was dropped
gets one notice that says how much was cut and how much is kept, then the
kept tail.

Times: a record of its own (stream ``TIME_MARK``, an 8-byte float of seconds
since the epoch, never going back) goes before the output written at least
``MARK_SECONDS`` after the last one; readers that ask for them (``marks``: the
merged, ``--since``-able logs) date each output by the last mark before it.
A log written before marks existed simply has none.

The newest records of a log being written (``RECENT_BYTES``) are also kept in
memory until it is closed: a live follower (an attached caller) that keeps up
reads them from there, the same records at the same offsets, without a trip
through the file system for each batch; one that falls behind, or comes
later, reads the files.
"""

from __future__ import annotations

import bisect
import errno
import os
import struct
import threading
import time

from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb

_FRAME = struct.Struct("<BI")    # output stream, length
_TAIL_SEGMENTS = 4
DEFAULT_MAX_LOG_BYTES = 1 << 30
MIN_LOG_BYTES = 512     # a tail segment (an eighth) holds a record with some data
RECENT_BYTES = 256 << 10    # the newest records of an open log, also in memory
TIME_MARK = 255             # a record's stream: not output, the time (see above)
_TIME = struct.Struct("<d")
MARK_SECONDS = 0.1


class StoreFull(OSError):
    """The disk under the agent's state directory is full."""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _open_append(path: str) -> int:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)   # made on first need
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


class HostLog:
    """One host's log of one job (the module's docstring says how it is kept).

    Why over 200 lines: its writing (segments and their bounds, time marks,
    the newest records kept in memory) and its reading (from the files, from
    memory, the notice of what was cut) share one set of offsets under one
    lock; apart, each half would have to know the other's layout."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_LOG_BYTES,
                 host: int = 0) -> None:
        self.path = path
        self.host = host
        self.max_bytes = max(MIN_LOG_BYTES, max_bytes)
        self.dropped = 0              # bytes that could not be stored (disk full)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._segment_start = 0       # offset of the open segment's first byte
        self._size = 0                # bytes in the open segment
        self._end = 0                 # offset after the last record
        self._tails: list[int] = []   # starts of the kept tail segments, oldest first
        # The newest records written, for live followers: their offsets and
        # frames (from ``_recent_first`` on), and the frames' bytes.
        self._recent_offsets: list[int] = []
        self._recent_frames: list[bytes] = []
        self._recent_first = 0
        self._recent_bytes = 0
        self._marked = 0.0            # the time in the last mark written

    # ------------------------------------------------------------ writing

    def _segment_path(self, start: int) -> str:
        return self.path if start == 0 else f"{self.path}.{start:020d}"

    def _open(self) -> None:
        """Continue where the files on disk end (a new log: at 0)."""
        _, self._tails = self.segments()
        self._segment_start = self._tails[-1] if self._tails else 0
        self._size = _size(self._segment_path(self._segment_start))
        self._end = self._segment_start + self._size
        self._fd = _open_append(self._segment_path(self._segment_start))

    def _next_segment(self) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        self._fd = _open_append(self._segment_path(self._end))
        self._segment_start, self._size = self._end, 0
        self._tails.append(self._end)
        while len(self._tails) > _TAIL_SEGMENTS:
            try:
                os.unlink(self._segment_path(self._tails.pop(0)))
            except OSError:
                pass

    def append(self, stream: int, data: bytes) -> None:
        """Store ``data``; raises :class:`StoreFull` when the disk is full (the
        record that did not fit is not stored at all; those before it, of a
        ``data`` split in several, stay)."""
        with self._lock:
            try:
                if self._fd is None:
                    self._open()
                self._mark()
                view = memoryview(data)
                while view:
                    n = self._fit(len(view))
                    start, frame = self._end, _FRAME.pack(stream, n) + view[:n]
                    self._write(frame)
                    self._remember(start, frame)
                    view = view[n:]
            except StoreFull:
                raise
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StoreFull(exc.errno, f"no space left for {self.path}") from exc
                raise

    def _mark(self) -> None:
        """(With ``_lock`` held.) A time mark, where the last is old enough
        (and it fits whole: a mark is never split)."""
        now = time.time()
        if now - self._marked < MARK_SECONDS or self._fit(_TIME.size) < _TIME.size:
            return
        self._marked = max(now, self._marked)
        start, frame = self._end, _FRAME.pack(TIME_MARK, _TIME.size) + _TIME.pack(self._marked)
        self._write(frame)
        self._remember(start, frame)

    def _limit(self) -> int:
        """What the open segment may hold."""
        return self.max_bytes // (2 if self._segment_start == 0 else 2 * _TAIL_SEGMENTS)

    def _fit(self, want: int) -> int:
        """How many of ``want`` bytes the next record takes: all of them (up to
        a chunk) where they fit what is left of the open segment, else the
        next one; as many as fit an empty segment."""
        n = min(want, CHUNK_SIZE)
        if self._size and self._size + _FRAME.size + n > self._limit():
            self._next_segment()
        return min(n, max(1, self._limit() - self._size - _FRAME.size))

    def _write(self, frame: bytes) -> None:
        assert self._fd is not None
        view = memoryview(frame)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            os.ftruncate(self._fd, self._size)    # readers would wait for half a record
            raise
        self._size += len(frame)
        self._end += len(frame)

    def _remember(self, start: int, frame: bytes) -> None:
        """Keep a record just written for live followers, the oldest let go
        past ``RECENT_BYTES``."""
        self._recent_offsets.append(start)
        self._recent_frames.append(frame)
        self._recent_bytes += len(frame)
        while self._recent_bytes > RECENT_BYTES and \
                self._recent_first < len(self._recent_frames) - 1:
            self._recent_bytes -= len(self._recent_frames[self._recent_first])
            self._recent_frames[self._recent_first] = b""
            self._recent_first += 1
        if self._recent_first > len(self._recent_frames) // 2:     # compact, now and then
            del self._recent_offsets[:self._recent_first]
            del self._recent_frames[:self._recent_first]
            self._recent_first = 0

    def close(self) -> None:
        """No more records: the file is closed, the memory of the newest let go."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._recent_offsets, self._recent_frames = [], []
            self._recent_first = self._recent_bytes = 0

    # ------------------------------------------------------------ reading

    def segments(self) -> tuple[int, list[int]]:
        """(size of the head file, starts of the tail segments on disk)."""
        directory, name = os.path.split(self.path)
        try:
            entries = os.listdir(directory)
        except FileNotFoundError:
            entries = []
        prefix = name + "."
        tails = sorted(int(e[len(prefix):]) for e in entries
                       if e.startswith(prefix) and e[len(prefix):].isdigit())
        return _size(self.path), tails

    def end(self) -> int:
        """The offset after the last record stored so far."""
        head, tails = self.segments()
        return tails[-1] + _size(self._segment_path(tails[-1])) if tails else head

    def read(self, offset: int, limit: int = 1 << 20, marks: bool = False
             ) -> list[tuple[int, bytes, int]]:
        """Whole records from ``offset``: (stream, data, offset after it); time
        marks among them only with ``marks`` (``TIME_MARK``: ``time_of``)."""
        while True:
            records = self._records(offset, limit)
            if marks or not records:
                return records
            out = [r for r in records if r[0] != TIME_MARK]
            if out:
                return out
            offset = records[-1][2]          # only marks: what follows them

    def _records(self, offset: int, limit: int) -> list[tuple[int, bytes, int]]:
        with self._lock:
            recent = self._read_recent(offset, limit)
        if recent is not None:
            return recent
        head, tails = self.segments()
        if tails and head <= offset < tails[0]:
            return [(pb.OUTPUT_STREAM_STDERR, self._cut_notice(offset, head, tails), tails[0])]
        start = max([0, *(t for t in tails if t <= offset)])
        try:
            with open(self._segment_path(start), "rb") as f:
                if offset - start >= os.fstat(f.fileno()).st_size:
                    return []
                f.seek(offset - start)
                blob = f.read(limit)
        except FileNotFoundError:
            return [] if start == 0 else self._records(offset, limit)   # dropped meanwhile
        out = []
        pos = 0
        while pos + _FRAME.size <= len(blob):
            stream, length = _FRAME.unpack_from(blob, pos)
            end = pos + _FRAME.size + length
            if end > len(blob):
                if not out and length + _FRAME.size > limit:    # a record larger than a read
                    return self._records(offset, length + _FRAME.size)
                break
            out.append((stream, blob[pos + _FRAME.size:end], offset + end))
            pos = end
        return out

    def _read_recent(self, offset: int, limit: int) -> list[tuple[int, bytes, int]] | None:
        """(With ``_lock`` held.) What ``read`` gives, from the newest records
        in memory; None where they do not hold ``offset`` (or what is on disk
        there could differ: below the kept tail, the files decide)."""
        if self._fd is None or offset < (self._tails[0] if self._tails else 0):
            return None
        if offset == self._end:
            return []
        i = bisect.bisect_left(self._recent_offsets, offset, self._recent_first)
        if i == len(self._recent_offsets) or self._recent_offsets[i] != offset:
            return None                   # older than the memory, or not a record's start
        # As from the files: one segment's records at a time.
        following = bisect.bisect_right(self._tails, offset)
        segment_end = self._tails[following] if following < len(self._tails) else self._end
        out, size = [], 0
        for k in range(i, len(self._recent_frames)):
            frame = self._recent_frames[k]
            if out and (size + len(frame) > limit or self._recent_offsets[k] >= segment_end):
                break
            size += len(frame)
            out.append((frame[0], frame[_FRAME.size:], self._recent_offsets[k] + len(frame)))
        return out

    def _cut_notice(self, offset: int, head: int, tails: list[int]) -> bytes:
        """What was cut from ``offset`` on, and what is kept (on disk now:
        records with their 5 bytes of framing each)."""
        tail = tails[-1] + _size(self._segment_path(tails[-1])) - tails[0]
        return (f"\n[remote_tpu: about {tails[0] - offset:,} bytes of host {self.host}'s "
                f"output were cut here; kept: the first {head:,} bytes and the last "
                f"{tail:,} (the agent keeps up to {self.max_bytes:,} bytes of each host's "
                "log: remote-tpu-agent --max-log-bytes)]\n").encode()


def time_of(data: bytes) -> float:
    """The time a ``TIME_MARK`` record holds (0.0 where it cannot be read)."""
    return _TIME.unpack(data)[0] if len(data) == _TIME.size else 0.0
