"""The text of the user's own files, carried with a call, so that a host that
never had them (a real TPU VM is not the laptop) shows their lines in a
traceback, under the names the user knows: a notebook cell as IPython names
it (``Cell In[3]``), a script or a local module by its path.

Only files whose code travels by value are carried (``serialization``
notes them as it pickles), never those of installed packages, which the host
has; a file over :data:`FILE_CHARS`, or past :data:`TOTAL_CHARS` for one
call, is named without its text (its frames then show no source line).
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Iterable

FILE_CHARS = 1 << 20
TOTAL_CHARS = 4 << 20

# This process's files from a client: name -> how the user knows it ("" for
# its own name). Read by the worker's traceback formatting.
DISPLAY_NAMES: dict[str, str] = {}

# filename -> (linecache's list of lines, their text): joined again only when
# linecache's lines for it change.
_texts: dict[str, tuple[list[str], str]] = {}


class Sources:
    """Files as ``{filename: (display name or "", text or None)}``; the
    :data:`SOURCES` marker pickles as those of the code pickled before it."""

    def __init__(self, files: dict[str, tuple[str, str | None]] | None = None) -> None:
        self.files = files or {}

    def __reduce__(self) -> tuple:
        return Sources, (self.files,)

    @classmethod
    def of(cls, filenames: Iterable[str]) -> Sources:
        from .local_modules import installed_file

        files: dict[str, tuple[str, str | None]] = {}
        total = 0
        for name in sorted(filenames):
            if installed_file(name):
                continue
            text = _text(name)
            if text is None:
                continue
            total += len(text)
            if len(text) > FILE_CHARS or total > TOTAL_CHARS:
                text = None
            files[name] = (_display_name(name), text)
        return cls(files)

    def install(self) -> None:
        """Make these files' lines this process's (``linecache``), whatever
        is or is not on this host's disk under their names."""
        for name, (display, text) in self.files.items():
            if display:
                DISPLAY_NAMES[name] = display
            if text is not None:
                # mtime None: linecache.checkcache leaves the entry alone.
                linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)


SOURCES = Sources()


def _text(name: str) -> str | None:
    linecache.checkcache(name)       # an edited and reloaded module: its new lines
    lines = linecache.getlines(name)
    if not lines:
        return None
    kept = _texts.get(name)
    if kept is not None and kept[0] is lines:
        return kept[1]
    text = "".join(lines)
    _texts[name] = (lines, text)
    return text


def _display_name(name: str) -> str:
    """How IPython shows a cell's frames (``Cell In[3]``), or "" for a file."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    number = numbers.get(name) if isinstance(numbers, dict) else None
    return f"Cell In[{number}]" if number is not None else ""
