"""Who this agent is and who its peers are, found the way JAX finds them.

Sources, in order:
1. explicit flags (``--worker-id``, ``--peers``): what the operator said wins;
2. the environment, as GKE sets it: ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``
   (comma separated, in worker order), ``TPU_ACCELERATOR_TYPE``, and where GKE
   runs several JAX processes per VM (TPU7x: two), ``TPU_PROCESS_ADDRESSES``
   (``host:port`` of every process, host by host). Read as JAX's own GKE
   cluster code reads them (``GkeTpuCluster`` in
   ``jax/_src/clusters/cloud_tpu_cluster.py``): the process list is
   ``TPU_PROCESS_ADDRESSES`` if set, else ``TPU_WORKER_HOSTNAMES``, and
   ``TPU_WORKER_ID`` is an index into it; this agent is the host of that
   process, its worker id that host's place among the hosts;
3. the GCE metadata server of a TPU VM: ``instance/attributes/agent-worker-number``,
   ``worker-network-endpoints`` (hostnames, or ``name:id:ip`` triples),
   ``accelerator-type`` and ``tpu-env``, asked with ``Metadata-Flavor: Google``,
   short timeouts and a few retries. ``GCE_METADATA_IP`` (the variable JAX
   reads for the same purpose) points it elsewhere, e.g. at a test stand-in;
4. none of these: a one-host slice.

Every agent of a slice listens on the same port, so a peer's agent address is
its host and this agent's port.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Mapping

from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.addresses import host_of, join_host_port
from remote_tpu._core.multislice import from_tpu_env, parse_tpu_env
from remote_tpu._core.topology import Topology

log = logging.getLogger(__name__)

METADATA_HOST_ENV = "GCE_METADATA_IP"
_DEFAULT_METADATA_HOST = "metadata.google.internal"


@dataclasses.dataclass(frozen=True)
class Slice:
    worker_id: int = 0
    peers: tuple[str, ...] = ()   # every agent of the slice, index = worker id
    accelerator: str = ""         # e.g. "v5p-32", when a source says
    source: str = "none"          # "flags", "environment", "metadata" or "none"
    # JAX processes per host where the environment lists them (TPU7x on GKE: 2).
    processes_per_host: int = 1
    # (num_slices, slice_id, coordinator host) where the TPU environment says
    # this slice is part of a multislice (``_core.multislice``).
    megascale: tuple[int, int, str] | None = None

    def describe(self) -> dict:
        return dataclasses.asdict(self)

    def processes_disagreement(self, processes_per_host: int) -> str:
        """Why a job's ``processes_per_host`` contradicts the processes this
        host's environment lists (its workers would see libtpu variables for
        another number of processes); "" where they agree or it lists one per
        host (any number of the job's own then replaces those variables)."""
        if self.source != "environment" or self.processes_per_host in (1, processes_per_host):
            return ""
        return (f"this slice's environment lists {self.processes_per_host} JAX process(es) "
                f"per host (TPU_PROCESS_ADDRESSES; TPU7x on GKE runs 2 per VM), but the job "
                f"asks for processes_per_host={processes_per_host}: use "
                f"processes_per_host={self.processes_per_host}")


class MetadataServer:
    """A small client of the GCE metadata server (or a stand-in)."""

    def __init__(self, host: str | None = None, *, timeout: float = 1.0,
                 attempts: int = 3) -> None:
        self.host = host or os.environ.get(METADATA_HOST_ENV) or _DEFAULT_METADATA_HOST
        self.timeout = timeout
        self.attempts = attempts

    def get(self, path: str) -> str | None:
        """The value at ``computeMetadata/v1/<path>``; None when it does not exist.
        Raises ConfigurationError when the server cannot be asked."""
        import urllib.error           # (here: only an agent that asks imports them)
        import urllib.request

        url = f"http://{self.host}/computeMetadata/v1/{path}"
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        last = ""
        for attempt in range(self.attempts):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    if reply.headers.get("Metadata-Flavor") != "Google":
                        raise ConfigurationError(
                            f"{url} answered without the 'Metadata-Flavor: Google' header: "
                            f"it is not a metadata server (check {METADATA_HOST_ENV})")
                    return reply.read().decode().strip()
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                last = f"HTTP {exc.code}"
                if exc.code < 500:
                    break
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                last = str(getattr(exc, "reason", exc))
            if attempt + 1 < self.attempts:
                time.sleep(0.2 * (attempt + 1))
        raise ConfigurationError(f"the metadata server at {self.host} did not answer "
                                 f"{path} ({last})")

    def attribute(self, key: str) -> str | None:
        return self.get(f"instance/attributes/{key}")

    def preempted(self) -> bool:
        """Whether this VM has been preempted (``instance/preempted`` is TRUE)."""
        try:
            return (self.get("instance/preempted") or "").upper() == "TRUE"
        except ConfigurationError as exc:
            log.debug("cannot ask about preemption: %s", exc)
            return False


def _worker_id(value: str, source: str) -> int:
    try:
        worker = int(value)
    except ValueError:
        raise ConfigurationError(f"{source} {value!r} is not a worker index (0, 1, ...)") \
            from None
    if worker < 0:
        raise ConfigurationError(f"{source} {value!r} is not a worker index (0, 1, ...)")
    return worker


def _hosts_from_endpoints(value: str, source: str) -> list[str]:
    hosts = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) == 1:
            hosts.append(parts[0])
        elif len(parts) == 3:        # name:id:ip, the older format
            hosts.append(parts[2])
        else:
            raise ConfigurationError(f"{source}: cannot read the endpoint {item!r} (expected "
                                     "a hostname or name:id:ip)")
    if not hosts:
        raise ConfigurationError(f"{source} lists no workers")
    return hosts


def _hosts_of_processes(value: str) -> tuple[list[str], int]:
    """``TPU_PROCESS_ADDRESSES`` -> (the hosts in order, processes per host).
    Process ``i`` is process ``i % n`` of host ``i // n``: the order JAX's
    process ids (``TPU_WORKER_ID``) and ours (host * n + k) both follow."""
    where = "TPU_PROCESS_ADDRESSES"
    hosts: list[str] = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        host = host_of(item)
        if not host:
            raise ConfigurationError(f"{where}: cannot read the address {item!r} "
                                     "(expected host:port)")
        hosts.append(host)
    if not hosts:
        raise ConfigurationError(f"{where} lists no processes")
    unique = list(dict.fromkeys(hosts))
    n, rest = divmod(len(hosts), len(unique))
    if rest or hosts != [h for h in unique for _ in range(n)]:
        raise ConfigurationError(
            f"{where} lists {len(hosts)} processes on {len(unique)} hosts that are not "
            f"grouped host by host, the same number on each ({value}); the agent numbers "
            "processes host * processes_per_host + k, as GKE lists them")
    return unique, n


def _from_environment(env: Mapping[str, str], port: int) -> Slice:
    """The slice as GKE's variables describe it (see the module docstring)."""
    processes = env.get("TPU_PROCESS_ADDRESSES")
    hostnames = env.get("TPU_WORKER_HOSTNAMES")
    index = _worker_id(env["TPU_WORKER_ID"], "TPU_WORKER_ID")
    if processes:
        hosts, n = _hosts_of_processes(processes)
        _check(index, [h for h in hosts for _ in range(n)], "TPU_PROCESS_ADDRESSES")
        worker = index // n
        if hostnames:
            named = [host_of(h) for h in _hosts_from_endpoints(hostnames,
                                                               "TPU_WORKER_HOSTNAMES")]
            if named != hosts:
                raise ConfigurationError(
                    f"TPU_WORKER_HOSTNAMES ({', '.join(named)}) and the hosts of "
                    f"TPU_PROCESS_ADDRESSES ({', '.join(hosts)}) differ: JAX reads "
                    "TPU_PROCESS_ADDRESSES; set both from the same pods, in the same order")
    else:
        hosts, n, worker = _hosts_from_endpoints(hostnames or "", "TPU_WORKER_HOSTNAMES"), \
            1, index
        _check(worker, hosts, "TPU_WORKER_HOSTNAMES")
    log.debug("slice from the environment: worker %d of %s, %d process(es) each", worker,
              hosts, n)
    return Slice(worker_id=worker, peers=tuple(join_host_port(h, port) for h in hosts),
                 accelerator=_accelerator(env.get("TPU_ACCELERATOR_TYPE"),
                                          "TPU_ACCELERATOR_TYPE"),
                 source="environment", megascale=from_tpu_env(env), processes_per_host=n)


def _accelerator(value: str | None, source: str) -> str:
    if not value:
        return ""
    try:
        Topology.parse(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: {exc}") from None
    return value


def _check(worker: int, hosts: list[str], source: str) -> None:
    if worker >= len(hosts):
        raise ConfigurationError(f"{source}: worker {worker} is not among the "
                                 f"{len(hosts)} workers listed ({', '.join(hosts)})")


def discover(*, port: int, worker_id: int | None = None, peers: tuple[str, ...] = (),
             env: Mapping[str, str] | None = None,
             metadata: MetadataServer | None = None, use_metadata: bool = True) -> Slice:
    """Find this agent's place in its slice; see the module docstring."""
    env = os.environ if env is None else env
    if peers or worker_id is not None:
        log.debug("slice from flags: worker %s, peers %s", worker_id, peers)
        worker = worker_id or 0
        if peers:
            _check(worker, list(peers), "--peers")
        return Slice(worker_id=worker, peers=tuple(peers), source="flags")
    hostnames = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hostnames and env.get("TPU_WORKER_ID") is not None:
        return _from_environment(env, port)
    log.debug("environment rejected: TPU_PROCESS_ADDRESSES/TPU_WORKER_HOSTNAMES=%r "
              "TPU_WORKER_ID=%r", hostnames, env.get("TPU_WORKER_ID"))
    if not use_metadata or env.get("TPU_SKIP_MDS_QUERY") is not None:
        log.debug("metadata server not asked")
        return Slice()
    server = metadata or MetadataServer()
    try:
        number = server.attribute("agent-worker-number")
    except ConfigurationError as exc:
        if METADATA_HOST_ENV in env:
            raise        # pointed at one on purpose: say what went wrong
        log.debug("metadata server rejected: %s", exc)
        return Slice()
    if number is None:
        log.debug("metadata server rejected: no agent-worker-number (not a TPU VM)")
        return Slice()
    worker = _worker_id(number, "metadata agent-worker-number")
    endpoints = server.attribute("worker-network-endpoints")
    if not endpoints:
        raise ConfigurationError("the metadata server has agent-worker-number but no "
                                 "worker-network-endpoints")
    hosts = _hosts_from_endpoints(endpoints, "metadata worker-network-endpoints")
    _check(worker, hosts, "metadata worker-network-endpoints")
    accelerator = _accelerator(server.attribute("accelerator-type"),
                               "metadata accelerator-type")
    log.debug("slice from the metadata server: worker %d of %s (%s)", worker, hosts,
              accelerator)
    megascale = from_tpu_env(parse_tpu_env(server.attribute("tpu-env") or ""))
    return Slice(worker_id=worker, peers=tuple(join_host_port(h, port) for h in hosts),
                 accelerator=accelerator, source="metadata", megascale=megascale)


def advertise_address(bind_host: str, explicit: str = "", listed: str = "") -> str:
    """The address peers use to reach this host (the JAX coordinator's host):
    the one given, else the one the slice lists for this worker (``listed``:
    its peers reach it there by definition; a hostname can resolve to a
    loopback address, as Debian's 127.0.1.1), else the one listened on, else
    the hostname's."""
    if explicit:
        return explicit
    if listed:
        return listed
    if bind_host not in ("", "0.0.0.0", "::", "[::]"):
        return bind_host.strip("[]")
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
