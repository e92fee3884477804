"""What a person sees while a call is in a long phase: a one-line live status
on a terminal or in a notebook (tqdm draws it: a text line on a terminal, a
widget or text in Jupyter) — uploading (bytes and rate), queued behind a job,
starting workers on N hosts, initializing JAX, the steps the function reports
(``remote_tpu.progress(step=)``: step, steps/s, the slowest host) — shown only once a phase has
lasted about a second, and gone for good as soon as the function prints or
the call ends. Nothing at all when stderr is not interactive (CI, pipes), so
the function's own output is never mixed with it.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

_SHOW_AFTER = 1.0          # seconds a phase lasts before it is shown
_REFRESH = 0.25


def interactive() -> bool:
    """A terminal, or a Jupyter kernel (whose stderr is not a terminal)."""
    if "ipykernel" in sys.modules and type(sys.stderr).__name__ == "OutStream":
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class LiveStatus:
    """One call's status line; every method is cheap and safe to call when
    it shows nothing."""

    def __init__(self, processes: int = 0, jax: bool = True,
                 enabled: bool | None = None) -> None:
        self.enabled = interactive() if enabled is None else enabled
        self.processes = processes
        self.jax = jax
        self._text = ""
        self._since = time.monotonic()
        self._bar = None
        self._done = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def phase(self, text: str) -> None:
        """The call is now in this phase (shown once it lasts)."""
        if not self.enabled or self._done:
            return
        with self._lock:
            if _kind(text) != _kind(self._text):
                self._since = time.monotonic()       # a new phase, not its progress
            self._text = text
            if self._thread is None:
                self._thread = threading.Thread(target=self._draw, daemon=True,
                                                name="remote_tpu-status")
                self._thread.start()

    def uploading(self, sent: int, total: int, started: float) -> None:
        rate = sent / max(1e-6, time.monotonic() - started)
        self.phase(f"remote_tpu: uploading {_size(sent)} of {_size(total)} "
                   f"({_size(rate)}/s)")

    def started(self, workers: int) -> None:
        if workers < self.processes:
            self.phase(f"remote_tpu: starting workers: {workers} of {self.processes} started")
        else:
            self.phase(f"remote_tpu: {self.processes} processes started"
                       f"{', initializing JAX' if self.jax else ''}; no output yet")

    def stepping(self, metrics) -> None:
        """The steps the function reports (``remote_tpu.progress(step=)``):
        "step 1200, 3.1 steps/s, slowest host 5" (``metrics``: every
        process's ``HostMetrics``)."""
        from ._top import summary

        if line := summary(metrics):
            self.phase(f"remote_tpu: running: {line}")

    def close(self) -> None:
        """Gone for good: the function prints, or the call ended."""
        if not self.enabled or self._done:
            return
        with self._lock:
            self._done = True
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()                  # leave=False: the line is erased

    def _draw(self) -> None:
        while True:
            time.sleep(_REFRESH)
            with self._lock:
                if self._done:
                    return
                if time.monotonic() - self._since < _SHOW_AFTER:
                    continue
                if self._bar is None:
                    self._bar = _new_bar()
                    if self._bar is None:
                        self._done = True
                        return
                self._bar.set_description_str(
                    f"{self._text} [{time.monotonic() - self._since:.0f} s]")


def _new_bar():
    import importlib

    try:
        make = importlib.import_module("tqdm.std").tqdm
    except ImportError:          # no tqdm: no status line, nothing else changes
        return None
    if "ipykernel" in sys.modules:
        try:                     # a notebook with widgets: tqdm's own widget
            importlib.import_module("ipywidgets")
            make = importlib.import_module("tqdm.notebook").tqdm
        except ImportError:      # none: the text line (Jupyter honours its \r)
            pass
    # The terminal's width (80 where it says 0, as a fresh pseudo-terminal does).
    return make(total=0, bar_format="{desc}", file=sys.stderr, leave=False,
                ncols=shutil.get_terminal_size().columns or 80)


def _kind(text: str) -> str:
    """Which phase a text tells of: its first word after "remote_tpu:"."""
    words = text.split()
    return words[1] if len(words) > 1 else text


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
