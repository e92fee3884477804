"""Jobs in Python's async world: a call's outcome as a real
``concurrent.futures.Future``, completed by a thread that waits on it, and
awaited from asyncio without blocking the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from ._core.exceptions import AgentUnavailableError, RemoteTPUError
from ._core.user_source import cut_sdk_frames

logger = logging.getLogger(__name__)
_watching = threading.Lock()         # one watching thread per handle
# A watching thread that loses its gateway (a network blip, an agent
# restarting) asks again, for up to this long in a row, before its Future ends
# with the error: a job may run for hours, and its end is what it waits for.
WATCH_PATIENCE = 600.0


def of_the_job(future: concurrent.futures.Future) -> bool:
    """Whether a done Future holds the job's own end (its value, or how it
    ended), not a failure to learn it (the gateway out of reach)."""
    exc = future.exception()
    return exc is None or getattr(exc, "remote_tpu_end", None) is not None


def tag_job(exc: BaseException, job_id: str) -> BaseException:
    """``exc.job_id = job_id`` on remote_tpu's own errors (unless set), and on
    another exception (the user's, rebuilt) unless it has a ``job_id`` of its
    own, which stays: its note names the job all the same."""
    if isinstance(exc, RemoteTPUError):
        if exc.job_id is None:
            exc.job_id = job_id
    elif not hasattr(exc, "job_id"):
        try:
            exc.job_id = job_id  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
    return exc


def in_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """A Future of ``fn()``, run in a daemon thread of its own (not a pool's:
    a call may wait for hours, and any number of them at once). The Future is
    running from the start: its ``cancel()`` is refused, as for a pool's task
    already begun; stopping the job is the handle's ``cancel()``."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:       # the caller's to see, whatever it is
            future.set_exception(exc)
        else:
            future.set_result(value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def awaited(future: concurrent.futures.Future, cancel: Callable[[], Any]) -> Any:
    """``future``'s value, awaited on the running loop. If the awaiting task
    is cancelled, ``cancel()`` (which stops the job) runs in a thread and is
    waited for before the task's CancelledError goes on."""
    __tracebackhide__ = True
    try:
        return await asyncio.wrap_future(future)
    except (Exception, KeyboardInterrupt) as exc:
        raise cut_sdk_frames(exc)       # from the thread, through asyncio: from here
    except asyncio.CancelledError:
        try:
            await asyncio.get_running_loop().run_in_executor(None, cancel)
        except Exception:
            logger.warning("remote_tpu: cancelling the job of a cancelled task failed",
                           exc_info=True)
        raise


class AsFuture:
    """A job handle's answers as a ``concurrent.futures.Future``'s, from its
    ``status()``, ``wait()``, ``result()`` and ``cancel()``; ``future()``: a
    real Future of its value, and ``await handle``."""

    _id: str
    _future: concurrent.futures.Future | None = None

    if TYPE_CHECKING:
        def status(self) -> Any: ...
        def wait(self, timeout: float | None = None) -> Any: ...
        def result(self, timeout: float | None = None) -> Any: ...
        def cancel(self) -> Any: ...

    def done(self) -> bool:
        """Whether the job has ended, in any way (asks its gateway)."""
        return self.status().finished

    def running(self) -> bool:
        """Whether the job has left the queue and not ended yet."""
        status = self.status()
        return not status.finished and status.state != "QUEUED"

    def cancelled(self) -> bool:
        """Whether the job ended cancelled (by ``cancel()`` or another caller)."""
        return self.status().state == "CANCELLED"

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception the job ended with, as ``result()`` raises it (the
        remote one rebuilt, or a ``JobFailedError``), or None if it succeeded.
        Raises ``JobTimeoutError`` (a ``TimeoutError``) if it has not ended
        within ``timeout`` seconds, and what keeps the answer from coming (an
        unreachable gateway, say)."""
        try:
            if self.wait(timeout).state == "SUCCEEDED":
                return None
        except Exception as exc:
            tag_job(exc, self._id)
            raise
        try:
            self.result()
        except Exception as exc:
            if getattr(exc, "remote_tpu_end", None) is None:
                raise                       # not the job's end: no answer
            return exc
        return None

    def future(self) -> concurrent.futures.Future:
        """A ``concurrent.futures.Future`` of the job's value (or remote
        exception), completed by a thread that waits for the job to end and
        fetches it: for ``concurrent.futures.wait`` and ``as_completed``. The
        same one each time; its ``cancel()`` is refused (``handle.cancel()``
        stops the job)."""
        with _watching:
            if self._future is None or (self._future.done() and
                                        not of_the_job(self._future)):
                # (none yet, or one that ended without the job's end: ask anew)
                self._future = in_thread(self._watch, name=f"remote_tpu job {self._id}")
            return self._future

    def _watch(self) -> Any:
        """``result()``, asked again while the gateway cannot be reached (for
        ``WATCH_PATIENCE`` seconds in a row at most): a Future, a callback or an
        ``await`` waits for the job's end, not for the first blip."""
        lost_since = None
        while True:
            try:
                return self.result()
            except AgentUnavailableError:
                now = time.monotonic()
                lost_since = lost_since if lost_since is not None else now
                if now - lost_since >= WATCH_PATIENCE:
                    raise
                time.sleep(min(5.0, 0.5 + (now - lost_since) / 10))

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(handle)`` once the job has ended, in the thread that
        watched it (at once, in this thread, where that thread has fetched its
        end already); an exception it raises is logged, as
        ``concurrent.futures`` does, not raised. A gateway out of reach is
        asked again for up to ``WATCH_PATIENCE`` seconds before ``fn`` runs
        with the job's end unknown (``handle.exception()`` then raises)."""
        self.future().add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, Any]:
        """``await handle``: its ``result()``, waited for in a thread. If the
        awaiting task is cancelled, the job is cancelled on every host
        (``asyncio.shield(handle)`` leaves it running)."""
        return awaited(self.future(), self.cancel).__await__()


class CallJob:
    """The job of one blocking call (or ``aio`` call), known as soon as its id
    is: for ``fn.last_job``, the exception's ``job_id``, and stopping the call
    when the task awaiting it is cancelled."""

    def __init__(self, made: Callable[[str, Any], Any]) -> None:
        self._made = made                 # its JobHandle, from its id and target
        self.job: Any = None
        self.cancelled = False

    def started(self, job_id: str, target: Any) -> None:
        """The call is about to send job ``job_id`` (again with a new id where
        the gateway had lost its large buffers, and for each attempt under
        ``retries=``); a call cancelled before that sends nothing."""
        if self.cancelled:
            raise concurrent.futures.CancelledError(
                f"job {job_id} was not sent: its awaiting task was cancelled")
        self.job = self._made(job_id, target)

    def tagged(self, exc: BaseException) -> BaseException:
        """``exc``, raised by the call, with its job's id (``tag_job``)."""
        return exc if self.job is None else tag_job(exc, self.job.id)

    def cancel(self, call: concurrent.futures.Future) -> None:
        """Stop the call running as ``call``: a job not yet sent is not sent;
        one sent is cancelled on every host. Between the two (uploading), the
        gateway does not know the job yet: asked again until it does, or until
        the call ended."""
        self.cancelled = True
        while not call.done():
            job = self.job
            if job is not None:
                try:
                    job.cancel()
                    return
                except RemoteTPUError:
                    pass                        # not at its gateway yet
            concurrent.futures.wait([call], timeout=0.2)
