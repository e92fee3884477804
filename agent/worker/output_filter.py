"""Worker output as the user should see it: start-up noise removed, the tail kept."""

from __future__ import annotations

import collections
import re

# JAX's CPU collectives (Gloo) print "[Gloo] Rank N is connected to M peer ranks.
# Expected number of connected peer ranks is : M" on stdout by themselves, from
# one thread per local device at once, so the pieces of several such messages
# arrive interleaved and spread over lines. A line made only of these pieces
# (and numbers) is noise. Each message starts with one "[Gloo] Rank" piece and has one
# newline: counting them tells how many bare-number or empty lines are noise too.
_PIECES = (b"[Gloo] Rank", b"is connected to", b"peer ranks.",
           b"Expected number of connected peer ranks is :")
_PIECE = re.compile(b"|".join(re.escape(p) for p in _PIECES))
_TOKEN = re.compile(_PIECE.pattern + rb"|\d+|\s+")
_START = _PIECES[0]


# One whole message, as a single thread prints it (it can also land in the
# middle of a line the user is writing from another thread).
_MESSAGE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                      rb"Expected number of connected peer ranks is : \d+")
_MESSAGE_ENDED = re.compile(_MESSAGE.pattern + rb"(?!\d)(?=.)", re.DOTALL)
_MESSAGE_PARTS = (b"[Gloo] Rank ", None, b" is connected to ", None,
                  b" peer ranks. Expected number of connected peer ranks is : ", None)


def _could_grow_into_message(text: bytes) -> bool:
    """Whether more bytes could turn ``text`` into a whole message (a message
    whose last number may still continue counts)."""
    pos = 0
    for part in _MESSAGE_PARTS:
        if part is None:                       # a number
            end = pos
            while end < len(text) and text[end:end + 1].isdigit():
                end += 1
            if end == len(text):
                return True
            if end == pos:
                return False
            pos = end
        else:
            n = min(len(part), len(text) - pos)
            if text[pos:pos + n] != part[:n]:
                return False
            pos += n
            if pos == len(text):
                return True
    return False


def _residue(data: bytes) -> bytes:
    """What is left of ``data`` from the first byte that is no noise token."""
    pos = 0
    while pos < len(data):
        m = _TOKEN.match(data, pos)
        if m is None:
            return data[pos:]
        pos = m.end()
    return b""


class NoiseFilter:
    """Drop Gloo's connection messages from a byte stream, keeping partial
    lines of the user's output live.

    A fragment without its newline passes at once unless it could still be
    noise; then it waits for the rest of its line (or :meth:`flush`).
    """

    def __init__(self) -> None:
        self._held = b""
        self._mid_line = False   # inside a line already shown: pass until newline
        self._owed = 0           # newlines still owed by Gloo messages seen

    def _is_noise(self, line: bytes) -> bool:
        if _residue(line):
            return False
        if _PIECE.search(line):
            self._owed += line.count(_START)
        elif self._owed <= 0:
            return False          # numbers or a blank line of the user's
        self._owed -= 1
        return True

    def _could_be_noise(self, partial: bytes) -> bool:
        rest = _residue(partial)
        if rest:
            return any(p.startswith(rest) for p in _PIECES)
        return bool(_PIECE.search(partial)) or self._owed > 0

    def _cut_messages(self, text: bytes, pattern: re.Pattern = _MESSAGE) -> bytes:
        """``text`` without the whole messages inside it; each message's own
        newline comes elsewhere, so it is owed."""
        text, cut = pattern.subn(b"", text)
        self._owed += cut
        return text

    def _split_partial(self, text: bytes) -> tuple[bytes, bytes]:
        """(what can be shown now, what must wait) for text without a newline."""
        text = self._cut_messages(text, _MESSAGE_ENDED)
        start = text.rfind(b"[")
        if start >= 0 and _could_grow_into_message(text[start:]):
            return text[:start], text[start:]
        return text, b""

    def feed(self, data: bytes) -> bytes:
        data = self._held + data
        self._held = b""
        if self._owed <= 0 and not any(piece in data for piece in _PIECES):
            # No Gloo message in sight: every whole line is the user's, as it is
            # (a million-line print loop must not pay a regex per line).
            nl = data.rfind(b"\n")
            if nl >= 0:
                self._mid_line = False
                return data[:nl + 1] + self._feed_lines(data[nl + 1:])
        return self._feed_lines(data)

    def _feed_lines(self, data: bytes) -> bytes:
        out = []
        pos = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if self._mid_line:
                if nl < 0:
                    shown, self._held = self._split_partial(data[pos:])
                    out.append(shown)
                    break
                out.append(self._cut_messages(data[pos:nl + 1]))
                pos = nl + 1
                self._mid_line = False
                continue
            if nl >= 0:
                line, pos = data[pos:nl + 1], nl + 1
                if not self._is_noise(line):
                    out.append(self._cut_messages(line))
                continue
            rest = data[pos:]
            if self._could_be_noise(rest):
                self._held = rest
            else:
                shown, self._held = self._split_partial(rest)
                out.append(shown)
                self._mid_line = True
            break
        return b"".join(out)

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        if not held or not _residue(held) and (_PIECE.search(held) or self._owed > 0):
            return b""
        return self._cut_messages(held)


class Tail:
    """The last ``n`` lines of a byte stream, for reports of dead hosts."""

    def __init__(self, n: int = 20) -> None:
        self._lines: collections.deque[bytes] = collections.deque(maxlen=n)
        self._partial = b""
        self._n = n

    def feed(self, data: bytes) -> None:
        cut = len(data)
        for _ in range(self._n + 1):     # only the last n lines can stay
            cut = data.rfind(b"\n", 0, cut)
            if cut < 0:
                break
        if cut >= 0:
            self._partial, data = b"", data[cut + 1:]
        parts = (self._partial + data).split(b"\n")
        self._partial = parts.pop()[-4096:]
        for p in parts:
            self._lines.append(p[-4096:])

    def lines(self) -> list[str]:
        out = list(self._lines) + ([self._partial] if self._partial else [])
        return [b.decode("utf-8", "replace") for b in out[-self._n:]]
