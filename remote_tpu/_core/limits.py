"""Sizes that keep every gRPC message under its limit, and the one way text is cut.

gRPC refuses a message over 4 MiB (``MAX_MESSAGE_BYTES``). Anything a reply
embeds that a user's code controls (exception messages, tracebacks, output
lines, stacks) is cut to the caps below, where it is made, keeping its head
and tail and saying in the text itself how much was cut and where the whole
of it is. Replies that gather many hosts' reports are bounded again as a whole.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 4 * 1024 * 1024   # gRPC's default limit, ours on both sides
CHUNK_SIZE = 1 << 20                  # payload, result and output chunks
# Payloads and values up to this size travel whole in one message (the job
# spec's, a worker's pipe frame): no file, no second message.
INLINE_BYTES = 1 << 20

EXCEPTION_MESSAGE_CHARS = 64 * 1024   # str(exc) in a host's report
TRACEBACK_CHARS = 64 * 1024           # its formatted traceback
PICKLED_EXCEPTION_BYTES = 1 << 20     # the exception itself, pickled
STACKS_CHARS = 256 * 1024             # one host's Python stacks
DETAIL_CHARS = 4 * 1024               # one-line details and status texts
JOB_END_BYTES = 2 << 20               # a job's final report, every host together
LIST_REPLY_BYTES = 3 << 20            # ListJobs and Stacks replies


def cut_text(text: str, limit: int, where: str = "") -> str:
    """``text`` if it fits in ``limit`` characters, else its head and tail
    around a note that says how much was cut (and ``where`` the whole is)."""
    if len(text) <= limit:
        return text
    note_room = 200 + len(where)
    keep = max(0, limit - note_room)
    head, tail = keep * 3 // 4, keep - keep * 3 // 4
    cut = len(text) - head - tail
    note = f"\n[... remote_tpu cut {cut:,} of {len(text):,} characters here"
    note += f"; {where}" if where else ""
    note += " ...]\n"
    return text[:head] + note + (text[-tail:] if tail else "")


def valid_text(text: object) -> str:
    """Text protobuf accepts: lone surrogates (an undecodable file name in an
    exception message, say) escaped."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


# all_results=: each process's value but process 0's, pickled, travels to the
# gateway in memory, and is bounded so (process 0's, as any job's value, is not).
OTHER_VALUE_BYTES = 64 << 20

# After a warm caller's first Ctrl-C (KeyboardInterrupt in the function on
# every host), how long the hosts have to come back to rest for the warm
# workers to stay; then the call is cancelled and they end.
INTERRUPT_SECONDS = 5.0

_SUBMIT_BASE_SECONDS = 600.0                # see upload_deadline
_SLOWEST_UPLOAD_BYTES_PER_SECOND = 1_000_000


def upload_deadline(payload_size: int) -> float:
    """Seconds an upload (Submit, PutBlob) of ``payload_size`` bytes may take
    and be answered.

    Keepalive pings (see ``channels.channel_options``) already end a call whose
    connection or agent host is gone; a deadline is still what ends one whose
    agent is alive but no longer reads (a full or hung disk, a bug), since gRPC
    answers pings by itself. A fixed deadline would fail the largest payloads
    on slow links (16 GiB in 600 s needs 28 MB/s), so it grows with the payload:
    600 s, plus 1 s per MB (16 GiB: about 5 hours)."""
    return _SUBMIT_BASE_SECONDS + payload_size / _SLOWEST_UPLOAD_BYTES_PER_SECOND
