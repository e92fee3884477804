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
import os
import sys
import traceback
from collections.abc import Iterable

FILE_CHARS = 1 << 20
TOTAL_CHARS = 4 << 20

# Set (to anything but "" or "0") where the SDK itself is being debugged: its
# own frames, remote and local, are shown too. The client passes it on to the
# hosts of its calls.
SHOW_SDK_FRAMES = "REMOTE_TPU_SHOW_SDK_FRAMES"

# This process's files from a client: name -> how a frame of it begins as
# the user knows it (``Cell In[3]``, ``File "sub/train.py"``). Read by the
# worker's traceback formatting.
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
            files[name] = (_cell_name(name), text)
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


def _cell_name(name: str) -> str:
    """How IPython shows a cell's frames (``Cell In[3]``), or "" for a file."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    number = numbers.get(name) if isinstance(numbers, dict) else None
    return f"Cell In[{number}]" if number is not None else ""


def show_sdk_frames() -> bool:
    return os.environ.get(SHOW_SDK_FRAMES, "") not in ("", "0")


def cut_sdk_frames(exc: BaseException) -> BaseException:
    """``exc`` to raise again at the SDK's entry point the user called: its
    frames inside the SDK cut (the raise there stays the one frame left; IPython
    hides it too, by its ``__tracebackhide__``), unless :data:`SHOW_SDK_FRAMES`."""
    return exc if show_sdk_frames() else exc.with_traceback(None)


def _sdk_dirs() -> tuple[str, ...]:
    """The directories of the SDK's own code in this process: remote_tpu and,
    on a host, its agent."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    agent = sys.modules.get("remote_tpu_agent")
    if agent is not None and getattr(agent, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(agent.__file__)))
    return tuple(d + os.sep for d in dirs)


class _UserStack(traceback.StackSummary):
    """Frames as the user knows them: a cell as ``Cell In[3], line 4``, a
    file of the working directory by its path inside it."""

    working_dir = ""

    def format_frame_summary(self, frame_summary: traceback.FrameSummary) -> str:
        text = super().format_frame_summary(frame_summary)
        name = frame_summary.filename
        head = DISPLAY_NAMES.get(name)
        if not head and self.working_dir and name.startswith(self.working_dir + os.sep):
            head = f'File "{os.path.relpath(name, self.working_dir)}"'
        return text.replace(f'File "{name}"', head, 1) if head else text


def format_exception(exc: BaseException, working_dir: str = "") -> str:
    """``exc``'s traceback as Python prints it, in the user's terms: the SDK's
    own frames left out (unless :data:`SHOW_SDK_FRAMES`), cells by name, files
    of ``working_dir`` (this host's copy) by their path in it, and the lines
    of files this host never had (carried by the call)."""
    report = traceback.TracebackException.from_exception(exc)
    _user_frames(report, () if show_sdk_frames() else _sdk_dirs(),
                 working_dir.rstrip(os.sep), set())
    return "".join(report.format())


def show_as(path: str, name: str) -> None:
    """Frames of ``path`` (in this process) read ``File "name"``: a script
    by the name its user typed."""
    DISPLAY_NAMES[path] = f'File "{name}"'


def _user_frames(report: traceback.TracebackException, hidden: tuple[str, ...],
                 working_dir: str, seen: set[int]) -> None:
    if id(report) in seen:
        return
    seen.add(id(report))
    stack = _UserStack(     # (from_list would make a plain StackSummary)
        f for f in report.stack if not (hidden and f.filename.startswith(hidden)))
    stack.working_dir = working_dir
    report.stack = stack
    for nested in (report.__cause__, report.__context__, *(report.exceptions or ())):
        if nested is not None:
            _user_frames(nested, hidden, working_dir, seen)
