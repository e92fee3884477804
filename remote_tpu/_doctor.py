"""`remote-tpu doctor HOSTS`: is the slice ready? One row per host.

With several slices (`remote-tpu doctor SLICE0 SLICE1 ...`, any agent of
each), every slice is checked, and every host of each slice tries to reach
every host of the others at MEGASCALE_PORT, as multislice traffic would cross
the data-center network (DCN) between them."""

from __future__ import annotations

from collections.abc import Sequence

from ._core.addresses import host_of, join_host_port
from ._core.auth import TLS
from ._core.multislice import MEGASCALE_PORT
from ._core.exceptions import AgentUnavailableError, RemoteTPUError
from ._core.proto import remote_tpu_pb2 as pb
from ._core.topology import Topology
from ._core.versions import differences, slice_skew
from ._target import resolve_target


def doctor_slices(slices: Sequence[str | Sequence[str]], token: str | None = None,
                  tls: TLS | None = None) -> tuple[list[list[str]], list[str]]:
    """(table rows, problems) for several slices, one entry each (any agent
    of it); hosts are named ``slice/host``."""
    found = [_ask(resolve_target(one, token=token, tls=tls), []) for one in slices]
    addresses = [[] if isinstance(reply, RemoteTPUError) else [h.address for h in reply.hosts]
                 for _, reply in found]
    rows, problems = [], []
    for s, (target, _) in enumerate(found):
        others = [join_host_port(host_of(a), MEGASCALE_PORT)
                  for o, row in enumerate(addresses) if o != s for a in row]
        _, reply = _ask(target, others) if addresses[s] else found[s]
        slice_rows, slice_problems = _rows(target, reply, prefix=f"{s}/")
        probes = [] if isinstance(reply, RemoteTPUError) else list(reply.probes)
        for row in slice_rows:
            mine = [p for p in probes if f"{s}/{p.host}" == row[0]]
            if mine:
                reached = sum(not p.error for p in mine)
                row[-1] += f"; DCN: reached {reached} of {len(mine)} hosts of the other slices"
        rows += slice_rows
        problems += [f"slice {s}: {p}" for p in slice_problems]
        for h in [] if isinstance(reply, RemoteTPUError) else reply.hosts:
            said = (h.health.megascale_num_slices, h.health.megascale_slice_id)
            if said[0] > 1 and said != (len(slices), s):
                problems.append(
                    f"slice {s} host {h.host} is slice {said[1]} of a multislice of "
                    f"{said[0]} by its own TPU environment (MEGASCALE_*), but is named as "
                    f"slice {s} of {len(slices)} here: a job listing the slices in this order "
                    "is refused; list them in the order of their slice ids")
        for probe in probes:
            if probe.error:
                problems.append(f"slice {s} host {probe.host} cannot reach {probe.address} "
                                f"(another slice's MEGASCALE_PORT) over the DCN: "
                                f"{probe.error}")
    return rows, problems


def _ask(target, probe: list[str]):
    try:
        return target, target.call(lambda t: t.stub().Doctor(
            pb.DoctorRequest(hosts=t.hosts, probe=probe), timeout=60,
            metadata=t.credentials.metadata))
    except RemoteTPUError as err:       # the gateway itself is the problem: one row
        return target, err


def doctor(hosts: str | Sequence[str] | None, token: str | None = None,
           tls: TLS | None = None) -> tuple[list[list[str]], list[str]]:
    """(table rows, problems) for the slice behind ``hosts`` (any agent of it)."""
    return _rows(*_ask(resolve_target(hosts, token=token, tls=tls), []))


def doctor_if_reachable(hosts: str | Sequence[str], token: str | None = None
                        ) -> tuple[list[list[str]], list[str]] | None:
    """As ``doctor``, or None where no agent answers at ``hosts`` (this
    machine cannot reach it, say)."""
    target, reply = _ask(resolve_target(hosts, token=token), [])
    return None if isinstance(reply, AgentUnavailableError) else _rows(target, reply)


def _rows(target, reply, prefix: str = "") -> tuple[list[list[str]], list[str]]:
    if isinstance(reply, RemoteTPUError):
        return [[f"{prefix}?", target.gateway, "NO", "", "", "", "", "", "", "",
             str(reply)]], \
            [str(reply)]
    rows, problems = [], []
    accelerators = set()
    for h in reply.hosts:
        if h.error:
            rows.append([f"{prefix}{h.host}", h.address, "NO", "", "", "", "", "", "", "",
                         h.error])
            problems.append(f"host {h.host} ({h.address}): {h.error}")
            continue
        v = h.health.versions
        notes = differences(v, releases=True)
        if h.health.tpu_busy:
            notes.append(h.health.tpu_busy)
        if h.health.accelerator:
            accelerators.add(h.health.accelerator)
        lock = "busy" if h.health.tpu_busy else "free"
        rows.append([f"{prefix}{h.host}", h.address, "yes", v.remote_tpu, v.python, v.jax or "-",
                     v.jaxlib or "-", v.libtpu or "-", h.health.accelerator or "-", lock,
                     "; ".join(filter(None, [*notes, h.health.idle_delete])) or "ok"])
        problems += [f"host {h.host}: {n}" for n in notes]
        if h.health.idle_delete_problem:
            problems.append(f"host {h.host}: {h.health.idle_delete_problem}")
    skew = slice_skew({f"host {h.host}": h.health.versions for h in reply.hosts if not h.error})
    if skew:
        problems.append("the hosts run different versions (a job on them is refused until "
                        "they match): " + "; ".join(skew))
    if len(accelerators) > 1:
        problems.append(f"hosts disagree on the accelerator: {', '.join(sorted(accelerators))}")
    elif accelerators:
        t = Topology.parse(accelerators.pop())
        if t.hosts != len(reply.hosts):
            problems.append(f"the slice is {t.name} ({t.hosts} hosts) but "
                            f"{len(reply.hosts)} agents answered for it")
    return rows, problems


def format_table(rows: list[list[str]]) -> str:
    header = ["HOST", "ADDRESS", "REACHABLE", "REMOTE_TPU", "PYTHON", "JAX", "JAXLIB",
              "LIBTPU", "ACCELERATOR", "TPU", "NOTES"]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in table]
    return "\n".join(lines)
