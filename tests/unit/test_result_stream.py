"""A value as the client puts it together from a Run or Result stream: its size
announced first, chunks written into one buffer, checked on the way."""

import numpy as np
import pytest

from remote_tpu._core import digests, serialization
from remote_tpu._core.exceptions import SerializationError
from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._outcome import _Value, outcome
from remote_tpu._render import OutputRenderer


class Stream:
    """Events as a gRPC stream gives them, and whether the caller cancelled it."""

    def __init__(self, events):
        self._events = iter(events)
        self.cancelled = False

    def __iter__(self):
        return self._events

    def cancel(self):
        self.cancelled = True


def value_events(data: bytes, *, announce: int | None = -1, digest: bytes | None = None):
    """A succeeded job's stream: size (``announce``: -1 the true one, None
    none, as an older gateway sends), chunks, end."""
    events = []
    if announce is not None:
        events.append(pb.Event(result_size=len(data) if announce < 0 else announce))
    events += [pb.Event(result_chunk=data[i:i + CHUNK_SIZE])
               for i in range(0, len(data), CHUNK_SIZE)]
    end = pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED, result_digest=digest or digests.of(data))
    return events + [pb.Event(end=end)]


def run(stream):
    return outcome(stream, OutputRenderer("none", "host"), gateway="127.0.0.1:1",
                   job_id="job-1", accelerator="tpu-v4-8")


@pytest.mark.parametrize("size", [0, 1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1,
                                  _Value.MAPPED, 3 * CHUNK_SIZE + 7])
def test_every_size_is_put_together_whole(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    value = _Value()
    value.sized(size)
    for i in range(0, size, CHUNK_SIZE):
        value.add(data[i:i + CHUNK_SIZE], "job-1")
    assert bytes(value.data("job-1")) == data
    assert value.digest.digest() == digests.of(data)


@pytest.mark.parametrize("value", [7, "x" * 100, np.arange(3 << 20, dtype=np.uint8)])
def test_values_small_and_large_come_back_equal(value):
    data = serialization.dumps(value, what="the return value").to_bytes()
    got = run(Stream(value_events(data)))
    if isinstance(value, np.ndarray):
        assert np.array_equal(got, value)
        got[0] = 99                                  # a value the caller owns: writable
    else:
        assert got == value


def test_a_gateway_that_announces_no_size_still_works():
    data = serialization.dumps(np.ones(2 << 20, dtype=np.uint8), what="v").to_bytes()
    assert int(run(Stream(value_events(data, announce=None))).sum()) == 2 << 20


@pytest.mark.parametrize("announce, words", [(5, "longer than the 5 bytes"),
                                             (10 << 20, "cut short")])
def test_a_value_longer_or_shorter_than_announced_is_refused_not_unpickled(announce, words):
    data = serialization.dumps(np.ones(2 << 20, dtype=np.uint8), what="v").to_bytes()
    stream = Stream(value_events(data, announce=announce))
    with pytest.raises(SerializationError, match=words):
        run(stream)
    assert stream.cancelled == (announce == 5)        # refused mid-stream: stream stopped


def test_a_value_that_does_not_match_its_digest_is_refused():
    data = serialization.dumps(list(range(10)), what="v").to_bytes()
    with pytest.raises(SerializationError, match="arrived corrupted"):
        run(Stream(value_events(data, digest=b"\0" * digests.SIZE)))


def test_a_value_too_large_for_this_process_says_so_and_where_it_stays():
    stream = Stream([pb.Event(result_size=1 << 62)])
    with pytest.raises(SerializationError, match="does not fit in this process's memory"):
        run(stream)
    assert stream.cancelled
