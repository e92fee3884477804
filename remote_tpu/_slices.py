"""``num_slices=N``: one job on N slices joined over the data-center network.

``hosts`` then names the slices, one entry per slice, slice 0 first; each entry
in any form ``hosts`` takes for one slice (its gateway's address, a list of its
hosts, ``tpu://NAME?zone=...``). One ``tpu://PREFIX?zone=...`` names the nodes
of a multislice queued resource, ``PREFIX-0`` .. ``PREFIX-{N-1}`` (the names
``gcloud compute tpus queued-resources create --node-count N --node-prefix
PREFIX`` gives them); ``"local"`` simulates N slices on this machine.

The client asks each slice's gateway for its hosts and sends slice 0's gateway
all of them, slice by slice: it runs the job on every host as one job (process
ids slice by slice, fail-fast across slices, one root cause). The variables
each host gets are ``_core.multislice``'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


from ._core.addresses import Hosts, TpuRef, parse_hosts
from ._core.auth import TLS
from ._core.channels import Credentials, health
from ._core.exceptions import ConfigurationError, RemoteTPUError
from ._core.multislice import MAX_SLICES, NUM_SLICES_ENV
from ._core.topology import Topology

_SET_BY_US = ("MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS")
_FORMS = ("one entry per slice (its gateway's address, a list of its hosts, or "
          "'tpu://NAME?zone=...'), 'local' to simulate them here, or one "
          "'tpu://PREFIX?zone=...' naming a multislice queued resource's nodes PREFIX-0, "
          "PREFIX-1, ...")


def num_slices_of(value: object) -> int:
    """``num_slices=`` (``REMOTE_TPU_NUM_SLICES``), checked: 1 to 64."""
    if value is None:
        raw = os.environ.get(NUM_SLICES_ENV) or "1"
        try:
            value = int(raw)
        except ValueError:
            raise ConfigurationError(f"{NUM_SLICES_ENV}={raw!r} is not a number of "
                                     "slices") from None
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 1 <= value <= MAX_SLICES:
        raise ConfigurationError(f"num_slices= must be a whole number of slices from 1 to "
                                 f"{MAX_SLICES}, got {value!r}")
    return value


def parse_slices(hosts: str | Sequence[str | Sequence[str]] | None, num_slices: int,
                 topology: Topology, env: Mapping[str, str]) -> tuple[Hosts, tuple[Hosts, ...]]:
    """(``hosts`` as one Hosts: the local slice, or slice 0; every slice's
    Hosts, empty for a local simulation) of a job on ``num_slices`` slices."""
    port = env.get("MEGASCALE_PORT")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigurationError(f"env= MEGASCALE_PORT={port!r} is not a port number (1-65535)")
    taken = sorted(set(env) & set(_SET_BY_US))
    if taken:
        raise ConfigurationError(f"env= sets {', '.join(taken)}, which remote_tpu sets on "
                                 f"each host of a num_slices={num_slices} job (slice ids, "
                                 "slice 0's worker 0): leave them out (MEGASCALE_PORT may "
                                 "be set)")
    if hosts is None:
        raw = os.environ.get("REMOTE_TPU_HOSTS") or "local"
        # $REMOTE_TPU_HOSTS: slices separated by ';', a slice's hosts by ','.
        hosts = [s.split(",") if "," in s else s for s in raw.split(";")] \
            if ";" in raw else raw
    if isinstance(hosts, str):
        one = parse_hosts(hosts)
        if one.local:
            return one, ()
        if one.tpu_url:
            ref = TpuRef.parse(one.tpu_url)
            query = one.tpu_url.split("?", 1)[1]
            hosts = [f"tpu://{ref.name}-{s}?{query}" for s in range(num_slices)]
        else:
            raise ConfigurationError(f"num_slices={num_slices} needs hosts= to name "
                                     f"{num_slices} slices: {_FORMS}; got {hosts!r}")
    if not isinstance(hosts, Sequence) or len(hosts) != num_slices:
        raise ConfigurationError(f"num_slices={num_slices} needs hosts= to name {num_slices} "
                                 f"slices: {_FORMS}; got {hosts!r}")
    slices = []
    for s, entry in enumerate(hosts):
        one = parse_hosts(entry if isinstance(entry, str) else list(entry))
        one = Hosts(one.entries, f"hosts[{s}] (slice {s})")
        if one.local:
            raise ConfigurationError("hosts='local' simulates every slice: give it alone, "
                                     "not as one slice of a list")
        if len(one.entries) > 1:
            topology.check_host_count(one.entries, one.source)
        slices.append(one)
    seen = [e for one in slices for e in one.entries]
    if len(set(seen)) != len(seen):
        raise ConfigurationError(f"hosts= names a host in two slices: {', '.join(seen)}")
    return slices[0], tuple(slices)


def slice_hosts(one: Hosts, s: int, num_slices: int, topology: Topology,
                token: str | None, tls: TLS | None) -> tuple[str, list[str]]:
    """(the address this client reaches slice ``s`` at, its hosts as the
    slices reach each other): the list the caller gave, or what its gateway
    says its slice is."""
    from ._target import resolve_target

    target = resolve_target(one, topology=topology, token=token, tls=tls)
    if target.hosts:
        return target.gateway, list(target.hosts)
    try:
        reply = health(target.gateway, target.credentials)
    except RemoteTPUError as exc:
        exc.add_note(f"(asking slice {s}'s agent at {target.gateway} for its hosts)")
        raise
    hosts = list(reply.peers) or [reply.agent_address or target.gateway]
    if len(hosts) != topology.hosts:
        raise ConfigurationError(
            f"slice {s} ({one.entries[0]}) has {len(hosts)} host(s) by its agent's account "
            f"({reply.slice_source or 'no discovery'}), but {topology.name} has "
            f"{topology.hosts}: use the accelerator each slice really is, or list the "
            f"slice's hosts as hosts[{s}]")
    if reply.accelerator:
        topology.check_same(reply.accelerator, f"slice {s} ({one.entries[0]})")
    if reply.megascale_num_slices > 1 and (reply.megascale_num_slices, reply.megascale_slice_id) \
            != (num_slices, s):
        raise ConfigurationError(
            f"hosts[{s}] ({one.entries[0]}) is slice {reply.megascale_slice_id} of a "
            f"multislice of {reply.megascale_num_slices} by its own TPU environment, but the "
            f"job lists it as slice {s} of {num_slices}: list the slices in the order of their "
            "slice ids, as many as were made together")
    gateway = reply.peers[0] if reply.peers and reply.worker_id != 0 else target.gateway
    return gateway, hosts


def resolve(slices: Sequence[Hosts], topology: Topology, token: str | None,
            tls: TLS | None):
    """The Target of a job on every slice: slice 0's gateway, every host."""
    from ._target import Target

    every: list[str] = []
    gateway = ""
    for s, one in enumerate(slices):
        reached, hosts = slice_hosts(one, s, len(slices), topology, token, tls)
        gateway = gateway or reached
        every += hosts
    if len(set(every)) != len(every):
        raise ConfigurationError("two slices of the job share a host (their agents name the "
                                 f"same peers): {', '.join(every)}")
    return Target(gateway, every, Credentials.for_client(token, tls))
