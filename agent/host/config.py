"""An agent's settings (from its command line), and what follows from them."""

from __future__ import annotations

import dataclasses

import grpc

from remote_tpu._core.auth import TLS
from remote_tpu._core.channels import Credentials

from remote_tpu_agent.wire.discovery import Slice
from remote_tpu_agent.jobs.host_log import DEFAULT_MAX_LOG_BYTES
from remote_tpu_agent.jobs.store import DEFAULT_MAX_STORE_BYTES
from remote_tpu_agent.host.tpu import DEFAULT_DEVICES, DEFAULT_LOCKFILE


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str = ""                 # address peers reach this host at
    slice: Slice = Slice()
    simulate_devices: int = 0           # > 0: JAX on CPU with this many devices
    state_dir: str = ""                 # job directories live here
    max_payload_bytes: int = 16 << 30
    token: str | None = dataclasses.field(default=None, repr=False)   # None: no auth
    tls_cert: str = ""                  # this agent's certificate and key (PEM files)
    tls_key: str = ""
    tls_ca: str = ""                    # CA of the slice's agents (and, with mtls, clients)
    mtls: bool = False                  # demand a client certificate signed by tls_ca
    pass_env: frozenset[str] = frozenset()   # more of the agent's variables for workers
    keep_jobs: int = 100                # finished jobs kept in the store
    tpu_lockfile: str = DEFAULT_LOCKFILE
    tpu_devices: tuple[str, ...] = DEFAULT_DEVICES
    kill_tpu_holders: bool = False
    peer_timeout: float = 10.0          # a silent peer is lost after this many seconds
    max_streams: int = 128              # long-lived calls served at once
    max_log_bytes: int = DEFAULT_MAX_LOG_BYTES       # per host and job: head and tail kept
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES   # every finished job's files together
    spare_workers: int = 1              # started ahead of their job (see worker.spares)
    light_spares: bool = False          # ... never with jax imported
    cache_bytes: int = 8 << 30          # the argument cache (see host.blobs)
    compilation_cache_bytes: int = 10 << 30   # JAX's persistent cache; 0 = none (worker.environment)
    cache_dir: str = ""                 # "" = /dev/shm where there is one, else state_dir
    data_port: int = 0                  # bulk bytes (see wire.data_port): 0 = any free, -1 = none
    output_interval: float = 30.0       # seconds between uploads of output_dir= files
    pythons: tuple[str, ...] = ()       # interpreters of other Python versions (host.pythons)
    python_downloads: bool = True       # uv may install a Python a client needs
    idle_delete_minutes: float = 0.0    # > 0: worker 0 deletes the slice so long idle
    idle_delete_resource: str = ""      # ... this queued resource or node (host.idle_delete)

    @property
    def peer_credentials(self) -> Credentials:
        """What this agent presents to its peers when it is the gateway."""
        tls = None
        if self.tls_ca:
            tls = TLS(ca=self.tls_ca, cert=self.tls_cert or None, key=self.tls_key or None)
        return Credentials(token=self.token, tls=tls, keepalive=self.peer_timeout)

    def server_credentials(self) -> grpc.ServerCredentials:
        """This agent's TLS side (``tls_cert`` set): its certificate, and with
        ``mtls`` the CA every client certificate must be signed by."""
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_server_credentials(
            [(read(self.tls_key), read(self.tls_cert))],
            root_certificates=read(self.tls_ca) if self.mtls else None,
            require_client_auth=self.mtls)
