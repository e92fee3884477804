"""remote_tpu: run one Python function on every host of a multi-host TPU slice.

    @remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
    def train():
        ...                 # runs on every host under an initialized jax.distributed
        return metrics      # only process 0's value comes back

Importing remote_tpu does not import jax.
"""

from ._core.auth import TLS
from ._decorator import RemoteFunction, run
from ._core.exceptions import (AgentUnavailableError, AuthenticationError, ConfigurationError,
                          JobFailedError,
                          JobTimeoutError, RemoteError, RemoteTPUError, RemoteTraceback,
                          SerializationError, VersionMismatchError)
from ._jobs import JobHandle, JobStatus, attach, jobs, release
from ._options import JaxTimeouts
from ._state import state  # a dict a warm worker keeps between calls (see _state)
from ._core.topology import Topology
from ._core.versions import __version__

__all__ = [
    "AgentUnavailableError",
    "AuthenticationError",
    "ConfigurationError",
    "JaxTimeouts",
    "JobFailedError",
    "JobHandle",
    "JobStatus",
    "JobTimeoutError",
    "RemoteError",
    "RemoteFunction",
    "RemoteTPUError",
    "RemoteTraceback",
    "SerializationError",
    "TLS",
    "Topology",
    "VersionMismatchError",
    "__version__",
    "attach",
    "jobs",
    "release",
    "run",
    "state",
]
