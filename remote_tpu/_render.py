"""Remote output onto the caller's sys.stdout / sys.stderr."""

from __future__ import annotations

import codecs
import sys
from typing import TextIO

from ._proto import remote_tpu_pb2 as pb


class OutputRenderer:
    """Writes remote output as it arrives. ``mode`` "all" prefixes each line
    with ``[host i]``; partial lines and split UTF-8 sequences are kept whole."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._decoders: dict[tuple[int, int], codecs.IncrementalDecoder] = {}
        self._line_start: dict[tuple[int, int], bool] = {}

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
        self._emit(key, decoder.decode(data))

    def close(self) -> None:
        for key, decoder in self._decoders.items():
            self._emit(key, decoder.decode(b"", final=True))

    def _emit(self, key: tuple[int, int], text: str) -> None:
        if not text:
            return
        if self.mode == "all":
            prefix = f"[host {key[0]}] "
            lines = text.splitlines(keepends=True)
            out = []
            for line in lines:
                if self._line_start.get(key, True):
                    out.append(prefix)
                out.append(line)
                self._line_start[key] = line.endswith("\n")
            text = "".join(out)
        target = self._target(key[1])
        target.write(text)
        target.flush()
