"""retries=: a call tried again after a preemption (many times) or after a
failure of the user's code (a few times, or not at all), told apart.

A preemption: the job ended PREEMPTED (a host's metadata server said so), or
LOST (its agent restarted under it), or its root cause is a host that
vanished (LOST), or the gateway could not be reached. A failure: the
function raised, a worker died, or the job timed out. A call refused before
anything ran (bad options, an unpicklable argument, a version mismatch) and a
cancelled one are never retried. Each attempt is a new job on every host, with
``REMOTE_TPU_ATTEMPT`` (0, 1, ...) in its environment so the function can
resume from its last checkpoint; each retry is announced on stderr with its
cause; when retries run out, the last error is raised, the earlier attempts'
causes noted on it. tenacity drives the loop and its backoff.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from ._core.exceptions import (AgentUnavailableError, AuthenticationError, ConfigurationError,
                               SerializationError, VersionMismatchError)

from ._core.states import FAILURE, PREEMPTION, end_cause, retry_kind  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Retries:
    """How many times a call is tried again after each kind of end, and how
    long to wait in between (``backoff`` seconds, doubling up to
    ``backoff_max``)."""

    preemptions: int = 100
    failures: int = 0
    backoff: float = 10.0
    backoff_max: float = 300.0

    def __post_init__(self) -> None:
        for name in ("preemptions", "failures"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigurationError(f"Retries({name}=...) must be an int >= 0, got {v!r}")
        for name in ("backoff", "backoff_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 86400:
                raise ConfigurationError(f"Retries({name}=...) must be seconds from 0 to "
                                         f"86400 (a day), got {v!r}")
        if self.preemptions + self.failures > 200:
            raise ConfigurationError(f"Retries(...) allows at most 200 retries in all, got "
                                     f"preemptions={self.preemptions}, "
                                     f"failures={self.failures}")


def coerce(value: int | Retries | None) -> Retries | None:
    """``retries=``: an int (that many retries after an end of either kind), a
    ``Retries``, or None / 0 (none)."""
    if value is None:
        return None
    if isinstance(value, Retries):
        return value if value.preemptions or value.failures else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"retries= must be an int >= 0 or remote_tpu.Retries(...), "
                                 f"got {value!r}")
    return Retries(preemptions=value, failures=value) if value else None


def kind_of(exc: BaseException) -> str | None:
    """PREEMPTION, FAILURE, or None for an end that is not retried."""
    if isinstance(exc, (KeyboardInterrupt, ConfigurationError, SerializationError,
                        VersionMismatchError, AuthenticationError)) and \
            getattr(exc, "remote_tpu_end", None) is None:
        return None                   # refused here, before anything ran
    if isinstance(exc, AgentUnavailableError):
        return PREEMPTION
    end = getattr(exc, "remote_tpu_end", None)
    if end is None:
        return None
    return retry_kind(end) or None


def _cause(exc: BaseException) -> str:
    end = getattr(exc, "remote_tpu_end", None)
    if end is not None:
        return end_cause(end)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run(retries: Retries | None, attempt: Callable[[int, list], Any]) -> Any:
    """``attempt(n, earlier)`` for n = 0, 1, ... until it returns, or until an
    end is not to be retried or its kind's retries are spent; ``earlier``: the
    attempts that ended before (``pb.Attempt``), for the job's status."""
    if retries is None:
        return attempt(0, [])
    import time

    import tenacity

    from ._core.proto import remote_tpu_pb2 as pb

    used = {PREEMPTION: 0, FAILURE: 0}
    causes: list[str] = []
    earlier: list = []

    def again(state: tenacity.RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome else None
        kind = kind_of(exc) if exc is not None else None
        if kind is None or (state.attempt_number == 1 and isinstance(exc, AgentUnavailableError)):
            return False       # a gateway never reached at all: a wrong address, not a loss
        limit = retries.preemptions if kind == PREEMPTION else retries.failures
        causes.append(f"attempt {state.attempt_number - 1} ({kind}): {_cause(exc)}")
        if used[kind] >= limit:
            return False
        end = getattr(exc, "remote_tpu_end", None)
        earlier.append(pb.Attempt(
            number=state.attempt_number - 1, job_id=getattr(exc, "remote_tpu_job", ""),
            state=end.state if end is not None else pb.JOB_STATE_LOST, kind=kind,
            cause=_cause(exc), root_cause_host=end.root_cause_host if end is not None else -1,
            ended_at=time.time()))
        used[kind] += 1
        print(f"remote_tpu: attempt {state.attempt_number - 1} ended by a {kind} "
              f"({_cause(exc)}); retrying ({used[kind]} of {limit} {kind} retries)",
              file=sys.stderr, flush=True)
        return True

    try:
        for trial in tenacity.Retrying(
                retry=again, reraise=True,
                wait=tenacity.wait_exponential(multiplier=retries.backoff,
                                               max=retries.backoff_max)):
            with trial:
                return attempt(trial.retry_state.attempt_number - 1, list(earlier))
    except BaseException as exc:
        if len(causes) > 1 and hasattr(exc, "add_note"):
            exc.add_note("remote_tpu: earlier attempts ended by:\n" +
                         "\n".join(f"  {c}" for c in causes[:-1]))
        raise
    raise AssertionError("unreachable")
