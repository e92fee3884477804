"""The argument cache on its own (agent/host/blobs.py): what it says when a
call's buffers can never all be in it at once. The cache on real agents:
tests/slice/test_argument_cache.py."""

from __future__ import annotations

CACHE = 4 << 20


def test_a_cache_says_when_a_calls_buffers_can_never_all_be_in_it(tmp_path):
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu_agent.host.blobs import BlobCache

    cache = BlobCache(str(tmp_path / "cache"), CACHE)
    try:
        refs = [pb.BlobRef(digest=bytes([i]) * 16, size=CACHE // 2) for i in range(2)]
        assert cache.too_small(refs + refs[:1]) == ""          # exactly: (one counted once)
        refs[1].size += 1                                        # one byte past
        assert cache.too_small(refs) == (
            f"its argument cache (--cache-bytes {CACHE:,}) is smaller than the "
            f"{CACHE + 1:,} bytes of buffers the call needs there at once: start it with "
            f"--cache-bytes {CACHE + 1} or more (give every agent of a slice the same)")
    finally:
        cache.close()
