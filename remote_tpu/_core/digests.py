"""The one content digest: of payloads, results and cached buffers.

xxh3-128 (``xxhash``): several times faster than sha256, which matters as a
large argument is hashed by the client, the gateway, every peer and every
worker (figures: benchmarks/README.md).
It detects corruption in transit or on disk, which is its job; it is not a
defence against someone crafting a collision, and needs not be: whoever can
send a payload holds the slice's token and may run any code there anyway, and
TLS (or an SSH tunnel) protects the bytes on the network.
"""

from __future__ import annotations

import xxhash

NAME = "xxh3-128"
SIZE = 16          # bytes


def new() -> xxhash.xxh3_128:
    """A digest to feed piece by piece (``update``, then ``digest``/``hexdigest``)."""
    return xxhash.xxh3_128()


def of(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128(data).digest()
