"""Questions about this host and its slice, not about a job: Health (this
agent) and Doctor (every agent of the slice, asked in parallel)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from remote_tpu._core.channels import health
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.versions import versions_pb

from ._config import AgentConfig
from ._tpu import TpuGuard


class SliceQueries:
    def __init__(self, config: AgentConfig, tpu: TpuGuard, endpoint: Callable[[], str]) -> None:
        self._config = config
        self._tpu = tpu
        self._endpoint = endpoint

    def health(self) -> pb.HealthReply:
        found = self._config.slice
        return pb.HealthReply(versions=versions_pb(), agent_address=self._endpoint(),
                              worker_id=found.worker_id, peers=found.peers,
                              simulate_devices=self._config.simulate_devices,
                              accelerator=found.accelerator, slice_source=found.source,
                              tpu_busy=self._tpu.busy())

    def doctor(self, hosts: list[str]) -> pb.DoctorReply:
        """Every host's health: of ``hosts`` (first = this one) when the client
        listed them, else of this slice's peers. An unreachable host is a row
        with its error, not a failed call."""
        if hosts:
            peers, me = list(hosts), 0
        else:
            peers = list(self._config.slice.peers) or [self._endpoint()]
            me = self._config.slice.worker_id
        credentials = self._config.peer_credentials

        def ask(i: int) -> pb.HostHealth:
            if i == me:
                return pb.HostHealth(host=i, address=peers[i], health=self.health())
            try:
                # Any address a client names: not kept in the shared cache.
                reply = health(peers[i], credentials, attempts=1, shared=False)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return pb.HostHealth(host=i, address=peers[i], error=str(exc))
            return pb.HostHealth(host=i, address=peers[i], health=reply)

        with concurrent.futures.ThreadPoolExecutor(min(32, len(peers))) as pool:
            return pb.DoctorReply(hosts=list(pool.map(ask, range(len(peers)))))
