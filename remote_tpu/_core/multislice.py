"""Several slices as one job (multislice over the data-center network).

One job of ``num_slices`` slices of H hosts each runs H x N hosts. Every host of
slice s gets the variables libtpu's multislice runtime reads, as Cloud TPU's
multislice queued resources, GKE's JobSet and Ray set them:

- ``MEGASCALE_NUM_SLICES`` = N, ``MEGASCALE_SLICE_ID`` = s;
- ``MEGASCALE_COORDINATOR_ADDRESS`` = the host (no port) of worker 0 of slice 0;
- ``MEGASCALE_PORT`` = 8081 unless said otherwise.

JAX's own Cloud TPU cluster detection (``jax/_src/clusters/cloud_tpu_cluster.py``,
``BaseTpuCluster``) derives from these: process id = slice id x processes per
slice + process id in the slice; process count = processes per slice x N; the
``jax.distributed`` coordinator on the host of ``MEGASCALE_COORDINATOR_ADDRESS``
(its port stripped). The gateway (worker 0 of slice 0) is process 0 and hosts
the coordinator, so the explicit arguments our workers pass agree with it.

A slice created as part of a multislice queued resource carries these values in
its TPU environment (``tpu-env`` in its metadata, or the variables on GKE):
``from_tpu_env`` reads them, and ``disagreement`` says how a job's differ.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from .addresses import host_of

MEGASCALE_PORT = 8081
NUM_SLICES_ENV = "REMOTE_TPU_NUM_SLICES"
MAX_SLICES = 64


def place(process_id: int, processes_per_slice: int) -> tuple[int, int]:
    """(slice id, process id within the slice) of a job's process."""
    return divmod(process_id, processes_per_slice)


def megascale_env(*, num_slices: int, slice_id: int, coordinator_host: str,
                  port: int = MEGASCALE_PORT) -> dict[str, str]:
    """The variables of every host of slice ``slice_id``."""
    return {
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_COORDINATOR_ADDRESS": coordinator_host,
        "MEGASCALE_PORT": str(port),
    }


def parse_tpu_env(text: str) -> dict[str, str]:
    """A TPU VM's ``tpu-env`` metadata (lines ``KEY: 'value'``), as a dict:
    read as JAX's ``get_tpu_env_value_from_metadata`` reads it."""
    values = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            values[key.strip()] = value.strip().strip("'")
    return values


def from_tpu_env(values: Mapping[str, str]) -> tuple[int, int, str] | None:
    """(num_slices, slice_id, coordinator host) where a slice's TPU environment
    says it is part of a multislice; None where it says nothing of one."""
    if not values.get("MEGASCALE_COORDINATOR_ADDRESS") or not values.get(
            "MEGASCALE_NUM_SLICES"):
        return None
    try:
        num = int(values["MEGASCALE_NUM_SLICES"])
        slice_id = int(values.get("MEGASCALE_SLICE_ID") or 0)
    except ValueError:
        return None
    coordinator = values["MEGASCALE_COORDINATOR_ADDRESS"]
    if num <= 1:
        return None            # a slice on its own: it may join any multislice job
    return num, slice_id, host_of(coordinator)     # JAX strips the port the same way


def same_host(a: str, b: str) -> bool:
    """Whether two host names or addresses name one host (as far as this
    machine's resolver can tell)."""
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def disagreement(said: tuple[int, int, str] | None, *, num_slices: int, slice_id: int,
                 coordinator_host: str) -> str:
    """Why a job's multislice numbers contradict what this slice's TPU
    environment says (``said``); "" where they agree or it says nothing."""
    if said is None:
        return ""
    num, sid, coordinator = said
    if num_slices <= 1:
        return ""          # a one-slice job on one slice of a multislice: its own business
    if num != num_slices:
        return (f"this slice was created as part of a multislice of {num} slices (its TPU "
                f"environment says MEGASCALE_NUM_SLICES={num}), but the job asks for "
                f"num_slices={num_slices}: use num_slices={num} and list its {num} slices")
    if sid != slice_id:
        return (f"this slice is slice {sid} of its multislice (its TPU environment says "
                f"MEGASCALE_SLICE_ID={sid}), but the job lists it as slice {slice_id}: list "
                "the slices in hosts= in the order of their slice ids")
    if not same_host(coordinator, coordinator_host):
        return (f"this slice's TPU environment names {coordinator} as the multislice "
                "coordinator (MEGASCALE_COORDINATOR_ADDRESS), not the job's first host: "
                "list slice 0 first, and reach it through its worker 0")
    return ""
