"""`remote-tpu doctor HOSTS`: is the slice ready? One row per host."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from ._auth import TLS
from ._cloud import is_tpu_url
from ._cloud import resolve as resolve_tpu
from ._options import normalize_address
from ._proto import remote_tpu_pb2 as pb
from ._proto import remote_tpu_pb2_grpc as pb_grpc
from ._topology import Topology
from ._transport import Credentials, error_from_rpc
from ._version import local_versions


def doctor(hosts: Sequence[str], token: str | None = None, tls: TLS | None = None
           ) -> tuple[list[list[str]], list[str]]:
    """(table rows, problems) for the slice behind ``hosts[0]``."""
    if is_tpu_url(hosts[0]):
        hosts = resolve_tpu(hosts[0])[0]
    addresses = [normalize_address(h) for h in hosts]
    gateway = addresses[0]
    credentials = Credentials.for_client(token, tls)
    with credentials.channel(gateway) as channel:
        try:
            reply = pb_grpc.AgentStub(channel).Doctor(
                pb.DoctorRequest(hosts=addresses if len(addresses) > 1 else []), timeout=30,
                metadata=credentials.metadata)
        except grpc.RpcError as exc:
            err = error_from_rpc(exc, gateway)
            return [[ "?", gateway, "NO", "", "", "", "", "", str(err)]], [str(err)]
    mine = local_versions()
    rows, problems = [], []
    accelerators = set()
    for h in reply.hosts:
        if h.error:
            rows.append([str(h.host), h.address, "NO", "", "", "", "", "", h.error])
            problems.append(f"host {h.host} ({h.address}): {h.error}")
            continue
        v = h.health.versions
        notes = []
        for name, theirs in (("remote_tpu", v.remote_tpu), ("python", v.python),
                             ("jax", v.jax), ("cloudpickle", v.cloudpickle)):
            ours = str(mine[name])
            if name == "python":
                same = theirs.split(".")[:2] == ours.split(".")[:2]
            else:
                same = theirs == ours
            if not same and not (name == "jax" and not ours):
                notes.append(f"{name} {theirs} (here {ours})")
        if v.protocol != mine["protocol"]:
            notes.append(f"protocol {v.protocol} (here {mine['protocol']})")
        if h.health.tpu_busy:
            notes.append(h.health.tpu_busy)
        if h.health.accelerator:
            accelerators.add(h.health.accelerator)
        lock = "busy" if h.health.tpu_busy else "free"
        rows.append([str(h.host), h.address, "yes", v.remote_tpu, v.python, v.jax or "-",
                     h.health.accelerator or "-", lock, "; ".join(notes) or "ok"])
        problems += [f"host {h.host}: {n}" for n in notes]
    if len(accelerators) > 1:
        problems.append(f"hosts disagree on the accelerator: {', '.join(sorted(accelerators))}")
    elif accelerators:
        t = Topology.parse(accelerators.pop())
        if t.hosts != len(reply.hosts):
            problems.append(f"the slice is {t.name} ({t.hosts} hosts) but "
                            f"{len(reply.hosts)} agents answered for it")
    return rows, problems


def format_table(rows: list[list[str]]) -> str:
    header = ["HOST", "ADDRESS", "REACHABLE", "REMOTE_TPU", "PYTHON", "JAX", "ACCELERATOR",
              "TPU", "NOTES"]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in table]
    return "\n".join(lines)
