"""Remote output onto the caller's sys.stdout / sys.stderr."""

from __future__ import annotations

import codecs
import collections
import sys
from collections.abc import Callable
from typing import IO, TextIO

from ._core.proto import remote_tpu_pb2 as pb


class OutputRenderer:
    """Writes remote output as it arrives; split UTF-8 sequences are kept whole.

    ``"leader"`` passes the leader's output through as is, partial lines
    included. ``"all"`` writes whole lines only, each prefixed ``[host i]``, so
    hosts never interleave inside a line; a last line without its newline is
    written when the job ends (``[slice s host i]`` in a job on several slices).
    ``"none"`` writes nothing.
    """

    def __init__(self, mode: str, label: str = "host", per_slice: int = 0) -> None:
        self.mode = mode
        self.label = label        # "process" when a host runs several
        self.per_slice = per_slice   # processes per slice of a multislice job; 0 = one slice
        self._decoders: dict[tuple[int, int], codecs.IncrementalDecoder] = {}
        self._partial: dict[tuple[int, int], str] = {}

    @staticmethod
    def _target(stream: int) -> TextIO:
        # Looked up per write: notebooks swap sys.stdout per cell.
        return sys.stderr if stream == pb.OUTPUT_STREAM_STDERR else sys.stdout

    def write(self, host: int, stream: int, data: bytes) -> None:
        if self.mode == "none":
            return
        key = (host, stream)
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self._decoders[key] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(data)
        if self.mode == "all":
            text = self._partial.pop(key, "") + text
            complete, newline, rest = text.rpartition("\n")
            if rest:
                self._partial[key] = rest
            text = self._prefixed(complete + newline, self._label(host))
        self._emit(stream, text)

    def close(self) -> None:
        for (host, stream), decoder in self._decoders.items():
            text = decoder.decode(b"", final=True)
            if self.mode == "all":
                text = self._prefixed(self._partial.pop((host, stream), "") + text,
                                      self._label(host))
            self._emit(stream, text)

    def _label(self, host: int) -> str:
        """``[host 3]``; in a multislice job ``[slice 1 host 1]``."""
        if not self.per_slice:
            return f"{self.label} {host}"
        s, i = divmod(host, self.per_slice)
        return f"slice {s} {self.label} {i}"

    @staticmethod
    def _prefixed(text: str, label: str) -> str:
        prefix = f"[{label}] "
        return "".join(prefix + line for line in text.splitlines(keepends=True))

    def _emit(self, stream: int, text: str) -> None:
        if text:
            target = self._target(stream)
            target.write(text)
            target.flush()


class LogPrinter:
    """Hosts' log bytes written out as text: as they are (one host), or line
    by line, each prefixed with its host, a host's unfinished line held back
    until its end comes (several hosts)."""

    def __init__(self, out: IO[str], label: Callable[[int], str] | None,
                 keep: Callable[[str], bool] | None = None) -> None:
        self._out = out
        self._label = label if label is not None or keep is None else (lambda h: "")
        self._keep = keep             # only the lines it keeps (then line by line)
        self._new = codecs.getincrementaldecoder("utf-8")
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}
        self._held: dict[int, str] = collections.defaultdict(str)

    def write(self, host: int, data: bytes) -> None:
        decoder = self._decoders.setdefault(host, self._new("replace"))
        self._text(host, decoder.decode(data))

    def end(self, host: int) -> None:
        """Host ``host``'s log is over: the rest of it, its last line ended."""
        decoder = self._decoders.pop(host, None)
        if decoder is not None:
            self._text(host, decoder.decode(b"", final=True))
        held = self._held.pop(host, "")
        if held and (self._keep is None or self._keep(held)):
            self._out.write(f"{self._label(host)}{held}\n")   # (held only with labels)
            self._out.flush()

    def _text(self, host: int, text: str) -> None:
        if not text:
            return
        if self._label is None:
            self._out.write(text)
        else:
            *lines, self._held[host] = (self._held[host] + text).split("\n")
            if self._keep is not None:
                lines = [line for line in lines if self._keep(line)]
            self._out.write("".join(f"{self._label(host)}{line}\n" for line in lines))
        self._out.flush()
