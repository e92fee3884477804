"""What an agent's two roles (gateway and peer) share of their host."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.host.blobs import BlobCache
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu_agent.worker.spares import Spares
from remote_tpu_agent.jobs.store import JobStore
from remote_tpu_agent.host.tpu import TpuGuard
from remote_tpu_agent.host.uploads import Uploads
from remote_tpu_agent.host.envs import Envs
from remote_tpu_agent.host.idle import IdleClock
from remote_tpu_agent.host.working_dirs import WorkingDirs


@dataclasses.dataclass(frozen=True)
class Host:
    """This agent's job store, payload uploads, argument cache, TPU guard, spare workers
    and the trees of working_dir= jobs,
    and what only the server can say: its endpoint (once bound), a worker's
    environment for a job spec, process id and coordinator, and whether this
    VM has been preempted; and the clock that tells how long it has been idle
    (``--idle-delete``)."""

    store: JobStore
    uploads: Uploads
    blobs: BlobCache
    tpu: TpuGuard
    spares: Spares
    endpoint: Callable[[], str]
    env_for: Callable[[pb.JobSpec, int, str], dict[str, str]]
    preempted: Callable[[], bool]
    workdirs: WorkingDirs
    envs: Envs
    output_interval: float = 30.0       # seconds between uploads of output_dir= files
    simulated: bool = False             # JAX on CPU (--simulate-devices): no jax[tpu]
    # Bulk bytes beside gRPC (none with TLS), once opened (after the gRPC port).
    data_port: Callable[[], DataPort | None] = lambda: None
    # Work comes and goes (``--idle-delete``): the roles hold it while theirs lasts.
    idle: IdleClock = dataclasses.field(default_factory=IdleClock.never)
