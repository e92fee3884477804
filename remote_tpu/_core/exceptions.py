"""Every error remote_tpu raises itself.

    RemoteTPUError                      base of everything below
    ├── ConfigurationError (ValueError) a bad option, accelerator or host list
    ├── SerializationError (TypeError)  something could not be pickled or unpickled
    ├── VersionMismatchError            client and agent cannot talk or share pickles
    ├── AuthenticationError (PermissionError)  the agent refused our credentials
    ├── AgentUnavailableError           no agent answered at the address given
    ├── JobFailedError                  a host died without a Python exception
    │   └── JobTimeoutError (TimeoutError)  the job ran past ``timeout=``
    └── RemoteError                     a remote exception that cannot be rebuilt here

A remote exception whose class *can* be rebuilt on the client is re-raised as
itself (``except ValueError:`` works); its ``__cause__`` is a
:class:`RemoteTraceback` holding the remote traceback text, and a note names the
host. Every message says what was received, what is allowed, and what to do next.

An error raised by a call, or by a handle's ``result()``, once its job had an
id carries it as ``job_id`` (None on one raised before); a re-raised remote
exception too, unless its own class has a ``job_id`` (its note names the job).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RemoteTPUError(Exception):
    """Base class of every error raised by remote_tpu itself. ``job_id``: the
    job it is about, where it came from a call or a handle (else None)."""

    job_id: str | None = None


class ConfigurationError(RemoteTPUError, ValueError):
    """An option, accelerator name or host list is not valid."""


class SerializationError(RemoteTPUError, TypeError):
    """The function, its arguments or its result could not be (un)pickled."""


class VersionMismatchError(RemoteTPUError):
    """Client and agent speak different protocols or Python/cloudpickle versions."""


class AuthenticationError(RemoteTPUError, PermissionError):
    """The agent refused this caller's token (or certificate)."""


class AgentUnavailableError(RemoteTPUError, ConnectionError):
    """No agent answered at the address given, or it dropped the call."""


class JobFailedError(RemoteTPUError):
    """The job failed without a Python exception to re-raise (a host died,
    was killed by a signal, or its agent was lost).

    ``host`` is the root-cause host, ``hosts`` the final report of every host.
    """

    def __init__(self, message: str, *, host: int | None = None,
                 hosts: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.host = host
        self.hosts = list(hosts)


class JobTimeoutError(JobFailedError, TimeoutError):
    """The job ran longer than its ``timeout=`` and was stopped on every host."""


class RemoteError(RemoteTPUError):
    """A remote exception whose class could not be rebuilt on the client.

    ``type_name`` is the remote exception's qualified class name,
    ``remote_traceback`` its formatted traceback, ``host`` the host it came from.
    """

    def __init__(self, message: str, *, type_name: str, remote_traceback: str,
                 host: int | None = None) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.remote_traceback = remote_traceback
        self.host = host


class RemoteTraceback(Exception):
    """Carries a remote traceback as the ``__cause__`` of a re-raised exception.

    Not raised on its own; its text is the traceback printed on the remote host.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text
