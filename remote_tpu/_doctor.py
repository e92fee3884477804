"""`remote-tpu doctor HOSTS`: is the slice ready? One row per host."""

from __future__ import annotations

from collections.abc import Sequence

from ._core.auth import TLS
from ._core.exceptions import RemoteTPUError
from ._core.proto import remote_tpu_pb2 as pb
from ._core.topology import Topology
from ._core.versions import differences
from ._target import resolve_target


def doctor(hosts: str | Sequence[str] | None, token: str | None = None,
           tls: TLS | None = None) -> tuple[list[list[str]], list[str]]:
    """(table rows, problems) for the slice behind ``hosts`` (any agent of it)."""
    target = resolve_target(hosts, token=token, tls=tls)
    try:
        reply = target.call(lambda t: t.stub().Doctor(
            pb.DoctorRequest(hosts=t.hosts), timeout=30, metadata=t.credentials.metadata))
    except RemoteTPUError as err:       # the gateway itself is the problem: one row
        return [["?", target.gateway, "NO", "", "", "", "", "", str(err)]], [str(err)]
    rows, problems = [], []
    accelerators = set()
    for h in reply.hosts:
        if h.error:
            rows.append([str(h.host), h.address, "NO", "", "", "", "", "", h.error])
            problems.append(f"host {h.host} ({h.address}): {h.error}")
            continue
        v = h.health.versions
        notes = differences(v, releases=True)
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
