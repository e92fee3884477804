"""The environment of a worker: what of the agent's it sees, JAX's variables and,
with several processes per host, the TPU variables that split the slice's chips
between them.

Several processes per host on a real TPU need libtpu's multi-process variables
(the pattern is that of JAX's own multi-process test harness,
``jax/_src/test_multiprocess.py``, for one host, and of torch_xla's
``configure_topology`` in ``torch_xla/_internal/tpu.py``,
https://github.com/pytorch/xla/blob/master/torch_xla/_internal/tpu.py, across
hosts):

- ``TPU_PROCESS_BOUNDS``: the grid of *all* the slice's processes: the slice's
  grid of hosts times each host's grid of processes (torch_xla multiplies the
  host bounds from the TPU metadata by the chips per process the same way).
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: the chips of one process, as a grid.
- ``TPU_PROCESS_ADDRESSES``: every process of every host, ``address:port``, host
  by host in worker order and on each host by local index; the k-th process of
  a host listens on ``TPU_PROCESS_BASE_PORT + k`` (torch_xla: "Assume each TPU has
  the same number of local processes with the same ports").
- ``TPU_PROCESS_PORT``: this process's own port from that list.
- ``TPU_VISIBLE_CHIPS``: this process's chips, numbered on its host.
- ``CLOUD_TPU_TASK_ID``: ``host * processes_per_host + k``, the index of this
  process in ``TPU_PROCESS_ADDRESSES`` (torch_xla: ``worker_id *
  local_world_size + local_rank``).

Host addresses are those of the slice's internal network, in worker order,
worker 0 first: JAX's Cloud TPU cluster detection
(``jax/_src/clusters/cloud_tpu_cluster.py``) likewise takes the slice's worker
list sorted by process id and makes its first entry the coordinator's host.
A one-host slice keeps ``localhost`` addresses, as JAX's harness sets them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.topology import HOST_GRID as _HOST_GRID, Bounds, Topology
from remote_tpu._core.addresses import host_of, join_host_port
from remote_tpu._core.multislice import MEGASCALE_PORT, megascale_env, place

from remote_tpu_agent.worker import child as _worker

# What of the agent's own environment a process it starts sees (a worker, a
# spare, a command a job runs, an installer, an interpreter probe): what a
# Python program needs to run, and what configures the accelerator stack.
# Nothing else (the agent's token least of all) unless the agent is started
# with --pass-env NAME. Where Google Cloud Storage is and which project
# (remote_tpu.Data fetches with them) pass; a credentials file does not (a TPU
# VM's come from its metadata server).
_PASSED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH",
    "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST",
})
_PASSED_PREFIXES = ("LC_", "TPU_", "JAX_", "XLA_", "LIBTPU_", "CLOUD_TPU_", "TF_CPP_",
                    "OPENBLAS_", "OMP_", "MKL_")
# An installer (pip, uv) and the interpreters it sets up also see their own
# configuration: the host's index, proxies and certificate authorities.
_INSTALLER_NAMES = frozenset({
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
})
_INSTALLER_PREFIXES = ("PIP_", "UV_")
# The agent's own variables (its token, token file, TLS key and certificate
# paths among them) never reach a child, even named with --pass-env; a worker
# gets the REMOTE_TPU_* of its job from worker_env alone.
_NEVER_PREFIX = "REMOTE_TPU_"


def child_environment(base: Mapping[str, str], extra: frozenset[str] = frozenset(),
                      installer: bool = False) -> dict[str, str]:
    """What of the agent's environment ``base`` a process the agent starts
    sees: the one rule for all of them (SECURITY.md). ``extra``: the names
    given with --pass-env; ``installer``: pip's and uv's configuration too."""
    def passed(name: str) -> bool:
        return (name in _PASSED_NAMES or name.startswith(_PASSED_PREFIXES) or name in extra
                or (installer and (name in _INSTALLER_NAMES
                                   or name.startswith(_INSTALLER_PREFIXES))))
    return {k: v for k, v in base.items() if passed(k) and not k.startswith(_NEVER_PREFIX)}


# JAX's persistent compilation cache (read by jax as it is imported: a spare has
# it, and a call that names another place, or none, gets a new worker).
CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
CACHE_MAX = "JAX_COMPILATION_CACHE_MAX_SIZE"
CACHE_ON = "JAX_ENABLE_COMPILATION_CACHE"


def compilation_cache_env(state_dir: str, max_bytes: int) -> dict[str, str]:
    """Every worker's default: a bounded directory of the agent's own (least
    recently used entries out first: jax's own eviction), or none."""
    if max_bytes <= 0:
        return {}
    path = os.path.join(state_dir, "compilation-cache")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return {CACHE_DIR: path, CACHE_MAX: str(max_bytes)}


def _compilation_cache(env: dict[str, str], where: str) -> None:
    """A call's ``compilation_cache=``: "" the agent's default, "off", or a
    place of its own (a gs:// URI or a path on the hosts, not bounded by us)."""
    if where == "off":
        env[CACHE_ON] = "false"
    elif where:
        env[CACHE_DIR] = where
        env.pop(CACHE_MAX, None)


def spare_env(base: Mapping[str, str], simulate_devices: int) -> dict[str, str]:
    """The environment a spare worker starts with: what every job's worker has
    before its own variables (``worker_env`` adds those; ``worker.spares.fits`` says
    whether a job's differ from it in anything read while starting up)."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    if simulate_devices:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def processes_per_host(spec: pb.JobSpec) -> int:
    return max(1, spec.processes_per_host)


def num_processes(spec: pb.JobSpec) -> int:
    return spec.num_hosts * processes_per_host(spec)


def num_slices(spec: pb.JobSpec) -> int:
    return max(1, spec.num_slices)


def hosts_per_slice(spec: pb.JobSpec) -> int:
    return max(1, spec.num_hosts // num_slices(spec))


TPU_PROCESS_BASE_PORT = 8476


def slice_host_bounds(accelerator: str | Topology) -> Bounds:
    """The grid of a slice's hosts (what the TPU metadata calls HOST_BOUNDS):
    ``tpu-v4-16`` -> (1, 1, 2) (2x2x2 chips, hosts of 2x2x1), ``tpu-v5litepod-16``
    -> (2, 2, 1) (4x4 chips, hosts of 2x2). A one-host slice is (1, 1, 1)."""
    topology = Topology.parse(accelerator)
    if topology.hosts == 1:
        return (1, 1, 1)
    gx, gy = _HOST_GRID.get(topology.chips_per_host, (1, topology.chips_per_host))
    a, b, c = topology.chip_bounds
    return (a // gx, b // gy, c)


def _bounds_from(value: str | None, hosts: int) -> Bounds | None:
    """``"1,1,2"`` -> (1, 1, 2) when it describes ``hosts`` hosts, else None."""
    try:
        dims = tuple(int(d) for d in (value or "").split(","))
    except ValueError:
        return None
    if len(dims) != 3 or min(dims) < 1 or math.prod(dims) != hosts:
        return None
    return dims[0], dims[1], dims[2]


def tpu_process_env(chips_per_host: int, n: int, k: int, *, host: int = 0,
                    host_addresses: Sequence[str] = ("localhost",),
                    host_bounds: Bounds = (1, 1, 1)) -> dict[str, str]:
    """The TPU variables of process ``k`` of the ``n`` processes of host ``host``.

    ``host_addresses`` are the slice's hosts (address only, no port) in worker
    order and ``host_bounds`` their grid; the defaults describe one host, whose
    processes reach each other on ``localhost``.
    """
    if len(host_addresses) != math.prod(host_bounds):
        raise ValueError(f"{len(host_addresses)} host address(es) for a slice of "
                         f"{'x'.join(map(str, host_bounds))} hosts")
    if not 0 <= host < len(host_addresses) or not 0 <= k < n or chips_per_host % n:
        raise ValueError(f"no process {k} of {n} on host {host} of {len(host_addresses)} "
                         f"with {chips_per_host} chips per host")
    gx, gy = _HOST_GRID.get(chips_per_host, (1, chips_per_host))
    per = chips_per_host // n
    # As JAX's own multi-process TPU harness sets them (jax/_src/test_multiprocess.py,
    # in the installed package): two chips of a 2x2 host go to a process as 1,2,1
    # (process bounds 2,1,1); otherwise whole rows of the host's grid.
    if (chips_per_host, per) == (4, 2):
        cx, cy = 1, 2
    else:
        cx = 1 if per < gx or per == 1 else gx
        cy = per // cx
    per_host = (gx // cx, gy // cy, 1)          # this host's processes, as a grid
    ports = [TPU_PROCESS_BASE_PORT + j for j in range(n)]
    return {
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in range(k * per, (k + 1) * per)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": f"{cx},{cy},1",
        "TPU_PROCESS_BOUNDS": ",".join(str(h * p) for h, p in zip(host_bounds, per_host)),
        "TPU_PROCESS_ADDRESSES": ",".join(join_host_port(address, port)
                                          for address in host_addresses for port in ports),
        "TPU_PROCESS_PORT": str(ports[k]),
        "CLOUD_TPU_TASK_ID": str(host * n + k),
        # Several libtpu processes on one host (JAX's harness sets it too).
        **({"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"} if n > 1 else {}),
    }


def slice_host_addresses(spec: pb.JobSpec, coordinator: str) -> list[str]:
    """The slice's host addresses (no port) in worker order, from a job's spec:
    worker 0 is the coordinator's host (the gateway's address as its peers reach
    it), the others are the agents the gateway reached (``spec.hosts[1:]``).
    Empty when the spec does not list every host."""
    if spec.num_hosts <= 1:
        return ["localhost"]
    if len(spec.hosts) != spec.num_hosts:
        return []
    return [host_of(coordinator), *(host_of(h) for h in spec.hosts[1:])]


def _tpu_variables(base: Mapping[str, str], spec: pb.JobSpec, process_id: int,
                   coordinator: str, host_addresses: Sequence[str]) -> dict[str, str]:
    """libtpu's multi-process variables: each slice of a multislice job is a
    TPU slice of its own (its hosts, its grid), joined to the others by
    libtpu's multislice runtime (MEGASCALE_*), not by these."""
    topology = Topology.parse(spec.accelerator)
    n = processes_per_host(spec)
    host, k = divmod(process_id, n)
    per_slice = hosts_per_slice(spec)
    slice_id, host = divmod(host, per_slice)
    if per_slice <= 1:
        return _gke_worker_id(base, tpu_process_env(topology.chips_per_host, n, k))
    addresses = list(host_addresses) or slice_host_addresses(spec, coordinator)
    if len(addresses) != spec.num_hosts:
        raise ValueError(
            f"process {process_id} of job {spec.job_id}: {n} processes per host on "
            f"{spec.num_hosts} hosts need every host's address for TPU_PROCESS_ADDRESSES, "
            f"got {len(addresses)} ({', '.join(addresses) or 'none'}); the gateway must "
            "send the slice's hosts in the job spec")
    addresses = addresses[slice_id * per_slice:(slice_id + 1) * per_slice]
    # A slice created with a topology other than the default (--topology) says
    # so in its own TPU_HOST_BOUNDS, when the agent's environment has it.
    bounds = (_bounds_from(base.get("TPU_HOST_BOUNDS"), per_slice)
              or slice_host_bounds(topology))
    return _gke_worker_id(base, tpu_process_env(topology.chips_per_host, n, k, host=host,
                                                host_addresses=addresses,
                                                host_bounds=bounds))


def _gke_worker_id(base: Mapping[str, str], env: dict[str, str]) -> dict[str, str]:
    """On GKE (the agent's environment has ``TPU_WORKER_ID``) a process's
    ``TPU_WORKER_ID`` is its index in ``TPU_PROCESS_ADDRESSES``, as JAX's
    ``GkeTpuCluster`` reads it: the process's own, not the agent's host's."""
    if "TPU_WORKER_ID" in base:
        env["TPU_WORKER_ID"] = env["CLOUD_TPU_TASK_ID"]
    return env


def worker_env(base: Mapping[str, str], *, spec: pb.JobSpec, process_id: int,
               coordinator: str, simulate_devices: int,
               host_addresses: Sequence[str] = ()) -> dict[str, str]:
    """The environment of one worker: the agent's (as child_environment has
    filtered it), the user's ``env=``, and JAX's.

    ``host_addresses``: the slice's hosts (address only, no port) in worker
    order; only needed with several processes per host on a multi-host TPU
    slice, and then taken from the spec (:func:`slice_host_addresses`) when
    not given.
    """
    n = processes_per_host(spec)
    env = dict(base)
    env.update(spec.env)
    env.update({
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(num_processes(spec)),
        "JAX_PROCESS_ID": str(process_id),
        "REMOTE_TPU_JOB_ID": spec.job_id,
        "REMOTE_TPU_HOST_INDEX": str(process_id // n),
        "REMOTE_TPU_PROCESS_INDEX": str(process_id),
        "REMOTE_TPU_NUM_HOSTS": str(spec.num_hosts),
        "REMOTE_TPU_ACCELERATOR": spec.accelerator,
        # The user's own Python subprocesses print as they go (the worker's own
        # streams are buffered and flushed on a timer: worker.child_output).
        "PYTHONUNBUFFERED": "1",
    })
    if num_slices(spec) > 1:
        env.update(_multislice_env(spec, process_id, coordinator))
    env["REMOTE_TPU_PROFILE"] = repr(spec.profile_seconds)    # always: "0.0" = off
    env[_worker.ENV_ALL_RESULTS] = "1" if spec.all_results else "0"   # always (a warm worker)
    _compilation_cache(env, spec.compilation_cache)
    # retries=: which attempt (the gateway's own count, or the client's in
    # spec.env); always set, so a warm worker never keeps an earlier job's.
    if spec.HasField("retries") or "REMOTE_TPU_ATTEMPT" not in spec.env:
        env["REMOTE_TPU_ATTEMPT"] = str(spec.attempt)
    # Always set: a spare started without JAX (``worker.spares``) reads it at its call.
    env[_worker.ENV_INIT_JAX] = "0" if spec.skip_jax_init else "1"
    timeouts = spec.jax_timeouts
    if timeouts.initialization_seconds:
        env[_worker.ENV_INIT_TIMEOUT] = str(timeouts.initialization_seconds)
    if timeouts.heartbeat_seconds:
        env[_worker.ENV_HEARTBEAT_TIMEOUT] = str(timeouts.heartbeat_seconds)
    if timeouts.shutdown_seconds:
        env[_worker.ENV_SHUTDOWN_TIMEOUT] = str(timeouts.shutdown_seconds)
    if simulate_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env[_worker.ENV_SIMULATE_DEVICES] = str(max(1, simulate_devices // n))
    elif n > 1:
        env.update(_tpu_variables(base, spec, process_id, coordinator, host_addresses))
    return env


def _multislice_env(spec: pb.JobSpec, process_id: int, coordinator: str) -> dict[str, str]:
    """MEGASCALE_* (``_core.multislice``) and which slice this process is in.
    The coordinator is process 0's host: worker 0 of slice 0."""
    slices = num_slices(spec)
    slice_id, _ = place(process_id, num_processes(spec) // slices)
    try:
        port = int(spec.env.get("MEGASCALE_PORT", MEGASCALE_PORT))
    except ValueError:
        raise ValueError(f"env= MEGASCALE_PORT={spec.env['MEGASCALE_PORT']!r} is not a "
                         "port number") from None
    return {**megascale_env(num_slices=slices, slice_id=slice_id,
                            coordinator_host=host_of(coordinator), port=port),
            "REMOTE_TPU_SLICE_ID": str(slice_id),
            "REMOTE_TPU_NUM_SLICES": str(slices)}
