"""What one agent is made of (``AgentParts``): its store, TPU guard, spare
workers, argument cache and data port, the ``Host`` the two roles share, the
gateway and peer roles and the read-only views, built from its configuration;
and their shutdown. The gRPC servicer (``server.service``) only maps each RPC
onto these."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading

from remote_tpu._core.addresses import host_of, join_host_port
from remote_tpu._core.multislice import disagreement
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.gateway.role import GatewayRole
from remote_tpu_agent.host.blobs import BlobCache
from remote_tpu_agent.host.cache_dir import cache_dir
from remote_tpu_agent.host.config import AgentConfig
from remote_tpu_agent.host.envs import Envs
from remote_tpu_agent.host.idle import IdleClock
from remote_tpu_agent.host.idle_delete import SliceDeleter
from remote_tpu_agent.host.output_dir import output_env
from remote_tpu_agent.host.pythons import Pythons
from remote_tpu_agent.host.shared import Host
from remote_tpu_agent.host.tpu import TpuGuard
from remote_tpu_agent.host.uploads import Uploads
from remote_tpu_agent.host.working_dirs import WorkingDirs
from remote_tpu_agent.jobs.store import JobStore
from remote_tpu_agent.jobs.views import JobViews
from remote_tpu_agent.peer.role import PeerRole
from remote_tpu_agent.server.slice_queries import SliceQueries
from remote_tpu_agent.wire.data_port import DataPort
from remote_tpu_agent.wire.discovery import MetadataServer, advertise_address
from remote_tpu_agent.worker.environment import (child_environment, compilation_cache_env,
                                                 num_processes, num_slices, processes_per_host,
                                                 spare_env, worker_env)
from remote_tpu_agent.worker.spares import Spares

log = logging.getLogger(__name__)


class AgentParts:
    """One agent's parts; ``port`` and ``data_port`` are set once the gRPC
    port is bound (``server.service.create_server``)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        found = config.slice
        listed = host_of(found.peers[found.worker_id]) if found.peers else ""
        self.address = advertise_address(config.host, config.advertise, listed)  # host only
        self.port = config.port          # the bound port, once create_server has bound it
        # No state dir given: an ephemeral agent's, removed when it stops.
        self._own_state_dir = not config.state_dir
        self.state_dir = config.state_dir or tempfile.mkdtemp(prefix="remote-tpu-agent-")
        self.store = JobStore(self.state_dir, keep=config.keep_jobs,
                              max_log_bytes=config.max_log_bytes,
                              max_store_bytes=config.max_store_bytes)
        uploads = Uploads(self.state_dir, lambda: self.endpoint, self.store.full_message)
        self.tpu = TpuGuard.for_agent(config.simulate_devices, config.tpu_lockfile,
                                      config.tpu_devices, config.kill_tpu_holders)
        self._worker_base_env = {
            **compilation_cache_env(self.state_dir, config.compilation_cache_bytes),
            **child_environment(os.environ, config.pass_env)}     # (the agent's own first)
        self.spares = Spares(spare_env(self._worker_base_env, config.simulate_devices),
                             self.state_dir, config.spare_workers, config.light_spares)
        self.blobs = BlobCache(cache_dir(config.cache_dir, self.state_dir),
                               config.cache_bytes)
        self.data_port: DataPort | None = None     # opened once the gRPC port is bound
        self.deleter, self.idle = _idle_delete(config)
        host = Host(store=self.store, uploads=uploads, blobs=self.blobs, tpu=self.tpu,
                    spares=self.spares,
                    endpoint=lambda: self.endpoint, env_for=self._env_for,
                    preempted=self.preempted,
                    workdirs=WorkingDirs(os.path.join(self.state_dir, "workdirs")),
                    envs=Envs(os.path.join(self.state_dir, "envs"), Pythons(
                        os.path.join(self.state_dir, "pythons"), config.pythons,
                        config.python_downloads, child_environment(
                            os.environ, config.pass_env, installer=True))),
                    output_interval=config.output_interval,
                    simulated=bool(config.simulate_devices),
                    data_port=lambda: self.data_port, idle=self.idle)
        self.gateway = GatewayRole(config=config, host=host, advertise=self.address)
        self.scheduler = self.gateway.scheduler
        self.peer = PeerRole(host)
        self.jobs = JobViews(self.store, config.slice, lambda: self.endpoint)
        self.queries = SliceQueries(config, self.tpu, lambda: self.endpoint, self.deleter)
        self.idle.start()

    @property
    def endpoint(self) -> str:
        return join_host_port(self.address, self.port)

    def _env_for(self, spec: pb.JobSpec, process_id: int, coordinator: str) -> dict[str, str]:
        if num_slices(spec) > 1:
            why = disagreement(self.config.slice.megascale, num_slices=num_slices(spec),
                               slice_id=process_id // (num_processes(spec) // num_slices(spec)),
                               coordinator_host=host_of(coordinator))
            if why:
                raise ValueError(why)
        why = self.config.slice.processes_disagreement(processes_per_host(spec))
        if why and not self.config.simulate_devices:
            raise ValueError(why)
        return {**worker_env(self._worker_base_env, spec=spec, process_id=process_id,
                             coordinator=coordinator,
                             simulate_devices=self.config.simulate_devices),
                **output_env(spec, self.state_dir, process_id),
                "REMOTE_TPU_GCS_CACHE": os.path.join(self.state_dir, "gcs-data")}

    def slice_peers(self) -> list[str]:
        """Every other agent of this slice, as its discovery found them."""
        found = self.config.slice
        return [p for i, p in enumerate(found.peers) if i != found.worker_id]

    def preempted(self) -> bool:
        """Whether this TPU VM has been preempted (asked only on a TPU VM)."""
        return self.config.slice.source == "metadata" and MetadataServer().preempted()

    def stop_all(self) -> None:
        """Agent shutdown: cancel every job (telling callers why) and kill every worker."""
        self.idle.stop()             # (ending jobs is no idleness)
        if self.preempted():
            self.scheduler.shutdown(f"host {self.endpoint} was preempted",
                                    pb.JOB_STATE_PREEMPTED)
        else:
            self.scheduler.shutdown(f"the gateway agent at {self.endpoint} is shutting down")
        self.peer.stop_all()
        self.spares.stop()
        if self.data_port is not None:
            self.data_port.close()
        self.blobs.close()
        self.store.close()
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def _idle_delete(config: AgentConfig) -> tuple[SliceDeleter | None, IdleClock]:
    """``--idle-delete``: on worker 0 (the gateway, which decides for the whole
    slice) a deleter and the clock that calls it; elsewhere a clock that never
    rings. The VM's scopes are read in the background: the agent listens at once."""
    if not config.idle_delete_minutes:
        return None, IdleClock.never()
    if config.slice.worker_id != 0:
        log.info("--idle-delete: worker %d leaves it to worker 0, which decides for the "
                 "whole slice", config.slice.worker_id)
        return None, IdleClock.never()
    deleter = SliceDeleter(config.idle_delete_minutes, config.idle_delete_resource)
    threading.Thread(target=deleter.check_access, daemon=True, name="idle-delete").start()
    return deleter, IdleClock(config.idle_delete_minutes * 60, deleter.delete)
