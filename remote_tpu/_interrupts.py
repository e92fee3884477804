"""A warm call's Ctrl-C, the notebook way (``FirstCtrlC``).

In a call with ``keep_warm=``, the first Ctrl-C (or a notebook's stop button:
SIGINT too) does not cancel the call: it asks the gateway to raise
KeyboardInterrupt inside the function on every host, so the user's code can
clean up, and the call goes on to its end. If every host comes back to rest
within ``INTERRUPT_SECONDS`` the warm workers, and ``remote_tpu.state``, stay;
otherwise the gateway stops them. Either way the caller then gets
KeyboardInterrupt. A second Ctrl-C cancels the call at once, as in a cold call.

Only where Ctrl-C would raise KeyboardInterrupt anyway (the main thread, with
Python's own handler, as plain Python and IPython kernels have it while code
runs); elsewhere Ctrl-C is left as it is.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from ._core.limits import INTERRUPT_SECONDS
from ._core.proto import remote_tpu_pb2 as pb


class FirstCtrlC:
    """While entered: the first SIGINT once the call is on its way
    (``ready``) calls ``ask`` (in a thread of its own) and says so; the next,
    or one before, raises KeyboardInterrupt. ``asked``: the first came.
    ``ask`` None: Ctrl-C is left as it is."""

    def __init__(self, job_id: Callable[[], str], ask: Callable[[], object] | None,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self._job_id = job_id
        self._ask = ask
        self._ready = ready
        self.asked = False
        self._installed = False

    def __enter__(self) -> FirstCtrlC:
        if self._ask is not None and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.asked or not self._ready():
            raise KeyboardInterrupt
        self.asked = True
        print(f"remote_tpu: interrupting job {self._job_id()}: KeyboardInterrupt in the "
              "function on every host; its warm workers stay if every host comes back "
              f"within {INTERRUPT_SECONDS:g} s (Ctrl-C again stops them now)",
              file=sys.stderr, flush=True)
        threading.Thread(target=self._send, daemon=True, name="remote-tpu-interrupt").start()

    def _send(self) -> None:
        assert self._ask is not None
        try:
            self._ask()
        except Exception as exc:  # noqa: BLE001 - said; then the call is cancelled
            why = exc.details() if callable(getattr(exc, "details", None)) else exc
            print(f"remote_tpu: the interrupt did not reach the slice ({why}): cancelling "
                  "the call instead", file=sys.stderr, flush=True)
            if self._installed:            # (as a second Ctrl-C would)
                _thread.interrupt_main(signal.SIGINT)


def raise_interrupted(job_id: str, end: pb.JobEnd | None,
                      error: BaseException | None) -> NoReturn:
    """What an interrupted warm call ends in: KeyboardInterrupt, saying what
    became of its warm workers (``end``: the call's last report, if one came;
    ``error``: what the call raised, shown above it unless the workers stay)."""
    if error is None:
        raise KeyboardInterrupt(
            f"job {job_id} had returned on every host before the interrupt reached its "
            "function (its value is dropped; the warm workers stay)")
    if end is not None and end.warm_kept:
        raise KeyboardInterrupt(
            f"job {job_id} was interrupted on every host; the warm workers were kept: "
            "remote_tpu.state and what is on the devices are as the call left them") \
            from None
    why = end.detail if end is not None and end.detail else str(error)
    raise KeyboardInterrupt(f"job {job_id} was interrupted: {why}") from error
