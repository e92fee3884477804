"""Remote output onto the caller's sys.stdout / sys.stderr."""

from __future__ import annotations

import codecs
import sys
from typing import TextIO

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
