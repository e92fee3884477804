"""Questions about this host and its slice, not about a job: Health (this
agent) and Doctor (every agent of the slice, asked in parallel)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import socket
import time
from collections.abc import Callable

from remote_tpu._core.channels import health
from remote_tpu._core.addresses import host_of
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._core.versions import versions_pb

from remote_tpu_agent.host.config import AgentConfig
from remote_tpu_agent.host.idle_delete import SliceDeleter
from remote_tpu_agent.host.tpu import TpuGuard


class SliceQueries:
    def __init__(self, config: AgentConfig, tpu: TpuGuard, endpoint: Callable[[], str],
                 deleter: SliceDeleter | None = None) -> None:
        self._config = config
        self._tpu = tpu
        self._endpoint = endpoint
        self._deleter = deleter         # --idle-delete, on the gateway

    def health(self) -> pb.HealthReply:
        found = self._config.slice
        num, slice_id, coordinator = found.megascale or (0, 0, "")
        idle_delete, problem = self._deleter.status() if self._deleter else ("", "")
        return pb.HealthReply(versions=versions_pb(), agent_address=self._endpoint(),
                              worker_id=found.worker_id, peers=found.peers,
                              simulate_devices=self._config.simulate_devices,
                              accelerator=found.accelerator, slice_source=found.source,
                              tpu_busy=self._tpu.busy(), megascale_num_slices=num,
                              megascale_slice_id=slice_id, megascale_coordinator=coordinator,
                              idle_delete=idle_delete, idle_delete_problem=problem)

    def doctor(self, hosts: list[str], probe: list[str] = ()) -> pb.DoctorReply:
        """Every host's health: of ``hosts`` (first = this one) when the client
        listed them, else of this slice's peers. An unreachable host is a row
        with its error, not a failed call. With ``probe``: every host also
        tries each of those addresses (``_probe``), each asked through its own
        Doctor call."""
        if hosts:
            peers, me = list(hosts), 0
        else:
            peers = list(self._config.slice.peers) or [self._endpoint()]
            me = self._config.slice.worker_id
        credentials = self._config.peer_credentials

        probes: list[pb.Probe] = []

        def ask(i: int) -> pb.HostHealth:
            if i == me:
                probes.extend(pb.Probe(host=i, **p.__dict__) for p in _probe_all(probe))
                return pb.HostHealth(host=i, address=peers[i], health=self.health())
            try:
                # Any address a client names: not kept in the shared cache.
                if probe:
                    reply = _doctor_of(peers[i], probe, credentials)
                    probes.extend(pb.Probe(host=i, address=p.address, error=p.error,
                                           seconds=p.seconds) for p in reply.probes)
                    return pb.HostHealth(host=i, address=peers[i], health=reply.hosts[0].health)
                answer = health(peers[i], credentials, attempts=1, shared=False)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                return pb.HostHealth(host=i, address=peers[i], error=str(exc))
            return pb.HostHealth(host=i, address=peers[i], health=answer)

        with concurrent.futures.ThreadPoolExecutor(min(32, len(peers))) as pool:
            rows = list(pool.map(ask, range(len(peers))))
        return pb.DoctorReply(hosts=rows, probes=sorted(probes, key=lambda p: p.host))


@dataclasses.dataclass
class _Probed:
    address: str
    error: str
    seconds: float


PROBE_SECONDS = 3.0


def _probe(address: str) -> _Probed:
    """Whether this host reaches ``address`` (host:port) over the network: a
    TCP connection made, or refused by that host (nothing listens on a
    MEGASCALE_PORT between jobs, but the network carried the attempt both
    ways), is reached; a timeout or no route is not."""
    start = time.monotonic()
    try:
        host, port = host_of(address), int(address.rsplit(":", 1)[1])
    except (ValueError, IndexError):
        return _Probed(address, "not an address host:port", 0.0)
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            error = ""
    except ConnectionRefusedError:
        error = ""
    except socket.timeout:
        error = f"no answer within {PROBE_SECONDS:g} s (a firewall dropping it?)"
    except OSError as exc:
        error = exc.strerror or str(exc)
    return _Probed(address, error, round(time.monotonic() - start, 3))


def _probe_all(addresses) -> list[_Probed]:
    if not addresses:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(32, len(addresses))) as pool:
        return list(pool.map(_probe, addresses))


def _doctor_of(address: str, probe, credentials) -> pb.DoctorReply:
    """A peer's own Doctor answer for itself alone, with its probes."""
    with credentials.channel(address) as channel:
        return pb_grpc.AgentStub(channel).Doctor(
            pb.DoctorRequest(hosts=[address], probe=list(probe)),
            timeout=PROBE_SECONDS + 10, metadata=credentials.metadata)
