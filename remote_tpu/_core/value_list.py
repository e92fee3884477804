"""``all_results=``: every process's pickled value joined into the job's one
value by the gateway, unread (it never unpickles what a user's function
returned), and split again by the caller, who unpickles each.

Layout: ``MAGIC`` (8 bytes), the number of values (u32), each one's length
(u64 each), then the values in process order. A plain value (one pickled
envelope: ``serialization``) starts with ``RTPU`` and its header's length, which
is never ``ALL1``: the two cannot be mistaken.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

MAGIC = b"RTPUALL1"


def header(lengths: Sequence[int]) -> bytes:
    """What goes before the values of these lengths, in order."""
    return MAGIC + struct.pack(f"<I{len(lengths)}Q", len(lengths), *lengths)


def split(data: bytes | bytearray | memoryview) -> list[memoryview] | None:
    """The values joined in ``data``; None when it is a plain value.
    ValueError when it is cut or longer than its header says."""
    view = memoryview(data)
    if view[:len(MAGIC)].tobytes() != MAGIC:
        return None
    pos = len(MAGIC)
    try:
        (count,) = struct.unpack_from("<I", view, pos)
        lengths = struct.unpack_from(f"<{count}Q", view, pos + 4)
    except struct.error:
        raise ValueError("a list of values whose header is cut short") from None
    pos += 4 + 8 * count
    if pos + sum(lengths) != len(view):
        raise ValueError(f"a list of {count} values of {sum(lengths):,} bytes arrived as "
                         f"{len(view) - pos:,}")
    parts = []
    for length in lengths:
        parts.append(view[pos:pos + length])
        pos += length
    return parts
