"""remote_tpu: run one Python function on every host of a multi-host TPU slice.

    @remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
    def train():
        ...                 # runs on every host under an initialized jax.distributed
        return metrics      # only process 0's value comes back

Importing remote_tpu does not import jax.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from ._core.exceptions import (AgentUnavailableError, AuthenticationError, ConfigurationError,
                               JobFailedError, JobTimeoutError, RemoteError, RemoteTPUError,
                               RemoteTraceback, SerializationError, VersionMismatchError)
from ._state import state  # a dict a warm worker keeps between calls (see _state)

# The rest is imported when first used: a worker (which imports remote_tpu to
# unpickle a function) pays for gRPC and protobuf only if the function does.
_LAZY = {
    "TLS": "._core.auth",
    "Data": "._data",
    "RemoteFunction": "._decorator", "run": "._decorator",
    "JobHandle": "._jobs", "JobStatus": "._jobs", "attach": "._jobs", "jobs": "._jobs",
    "release": "._jobs",
    "JaxTimeouts": "._options",
    "Retries": "._retries",
    "output_dir": "._output_files",
    "Topology": "._core.topology",
    "progress": "._core.progress",
    "__version__": "._core.versions",
}

if _TYPE_CHECKING:
    from ._core.auth import TLS
    from ._core.progress import progress
    from ._core.topology import Topology
    from ._core.versions import __version__
    from ._data import Data
    from ._decorator import RemoteFunction, run
    from ._jobs import JobHandle, JobStatus, attach, jobs, release
    from ._options import JaxTimeouts
    from ._output_files import output_dir
    from ._retries import Retries


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'remote_tpu' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AgentUnavailableError",
    "AuthenticationError",
    "ConfigurationError",
    "Data",
    "JaxTimeouts",
    "JobFailedError",
    "JobHandle",
    "JobStatus",
    "JobTimeoutError",
    "RemoteError",
    "RemoteFunction",
    "RemoteTPUError",
    "RemoteTraceback",
    "Retries",
    "SerializationError",
    "TLS",
    "Topology",
    "VersionMismatchError",
    "__version__",
    "attach",
    "jobs",
    "output_dir",
    "progress",
    "release",
    "run",
    "state",
]
