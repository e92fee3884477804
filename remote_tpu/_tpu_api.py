"""Slices made and removed on demand: ``remote-tpu up``, ``down`` and ``slices``,
through the Cloud TPU API's queued resources (Google's ``google-cloud-tpu``
library, v2; ``pip install 'remote-tpu[gcp]'``).

``up`` asks for a queued resource holding the slice (or ``num_slices`` of them),
spot or reserved, and shows its state while it waits: queued resources can wait
minutes or hours for capacity, and Ctrl-C leaves the request standing, saying how
to delete it. ``down`` deletes a queued resource and its nodes (a node made by
hand, without one, too). ``slices`` lists a zone's queued resources and nodes,
each with its state and whether an agent answers on its first worker.

``REMOTE_TPU_TPU_API`` points the library at another endpoint than Google's (an
``http://127.…`` stand-in, with anonymous credentials, in the tests).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ._cloud import API_ENV, credentials_and_project
from ._core.addresses import DEFAULT_AGENT_PORT, join_host_port
from ._core.exceptions import ConfigurationError, RemoteTPUError
from ._core.topology import Topology

# The TPU VM image each generation boots by default (Cloud TPU's documented
# runtimes; --runtime-version picks another).
DEFAULT_RUNTIME = {"v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base",
                   "v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite",
                   "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
POLL_ENV = "REMOTE_TPU_UP_POLL_SECONDS"        # seconds between looks while up waits
CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
_WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")


def _library():
    try:
        from google.api_core import exceptions
        from google.cloud import tpu_v2
    except ImportError:
        raise ConfigurationError("remote-tpu up, down and slices need Google's Cloud TPU "
                                 "library: pip install 'remote-tpu[gcp]'") from None
    return tpu_v2, exceptions


def _client_and_project(project: str):
    """The library's client (REST to ``REMOTE_TPU_TPU_API`` where set) and the project."""
    tpu_v2, _ = _library()
    from google.api_core.client_options import ClientOptions

    credentials, project = credentials_and_project(
        project, needs="remote-tpu up, down and slices",
        no_project="which project? give --project PROJECT (the credentials name no "
                   "default project)")
    endpoint = os.environ.get(API_ENV, "").rstrip("/")
    options = ClientOptions(api_endpoint=endpoint) if endpoint else None
    client = tpu_v2.TpuClient(credentials=credentials, transport="rest",
                              client_options=options)
    return client, project


def _api_error(what: str, exc: Exception) -> RemoteTPUError:
    message = getattr(exc, "message", "") or str(exc)
    return RemoteTPUError(f"the Cloud TPU API refused to {what}: {message}")


def node_spec(name: str, accelerator: str, runtime_version: str, num_slices: int,
              spot: bool, reserved: bool, parent: str, cloud_scope: bool = False):
    """The queued resource ``up`` asks for; ``cloud_scope``: its VMs' default
    service account with the cloud-platform scope (an agent deletes its own
    idle slice with it)."""
    tpu_v2, _ = _library()
    topology = Topology.parse(accelerator)
    runtime = runtime_version or DEFAULT_RUNTIME.get(topology.generation, "")
    if not runtime:
        raise ConfigurationError(f"no default TPU VM image for {topology.name}: give "
                                 "--runtime-version")
    node = tpu_v2.Node(accelerator_type=topology.name.removeprefix("tpu-"),
                       runtime_version=runtime,
                       scheduling_config=tpu_v2.SchedulingConfig(reserved=reserved))
    if cloud_scope:
        node.service_account = tpu_v2.ServiceAccount(scope=[CLOUD_SCOPE])
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node=node)
    if num_slices > 1:
        spec.multislice_params = tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
            node_count=num_slices, node_id_prefix=name)
    else:
        spec.node_id = name
    resource = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    if spot:
        resource.spot = tpu_v2.QueuedResource.Spot()
    return resource


def _poll_seconds() -> float:
    """Read at each look (not at import), so the variable set later counts."""
    text = os.environ.get(POLL_ENV, "") or "10"
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigurationError(f"${POLL_ENV}={text!r}: give seconds, e.g. 10") from None
    if not 0 < seconds <= 3600:
        raise ConfigurationError(f"${POLL_ENV}={text!r}: give seconds above 0, up to 3600")
    return seconds


def _state(resource) -> tuple[str, str]:
    """(state name, why it failed, if it did)."""
    state = resource.state.state.name
    failed = resource.state.failed_data.error.message if state == "FAILED" else ""
    return state, failed


def queued_resource(name: str, zone: str, project: str = "") -> str:
    """The full name of queued resource ``name`` (the project: as ``up`` finds it)."""
    _, project = credentials_and_project(
        project, needs="remote-tpu up", no_project="which project? give --project PROJECT")
    return f"projects/{project}/locations/{zone}/queuedResources/{name}"


def up(name: str, accelerator: str, zone: str, project: str = "", *, spot: bool = False,
       reserved: bool = False, num_slices: int = 1, runtime_version: str = "",
       wait: bool = True, cloud_scope: bool = False,
       say: Callable[[str], None] = print) -> list[str]:
    """Ask for the slice; with ``wait``, until it is ACTIVE: its nodes' names."""
    if spot and reserved:
        raise ConfigurationError("--spot and --reserved exclude each other: give one")
    if not 1 <= num_slices <= 64:
        raise ConfigurationError(f"--num-slices {num_slices}: give 1 to 64")
    client, project = _client_and_project(project)
    parent = f"projects/{project}/locations/{zone}"
    resource = node_spec(name, accelerator, runtime_version, num_slices, spot, reserved, parent,
                         cloud_scope)
    _, errors = _library()
    try:
        client.create_queued_resource(parent=parent, queued_resource=resource,
                                      queued_resource_id=name).result(timeout=120)
    except errors.Conflict:           # (AlreadyExists, or HTTP 409 over REST)
        say(f"queued resource {name} exists already in {zone}: following it")
    except errors.GoogleAPICallError as exc:
        raise _api_error(f"create queued resource {name} in {zone}", exc) from None
    delete = f"remote-tpu down {name} --zone {zone} --project {project}"
    say(f"asked for {accelerator}{f' x {num_slices}' if num_slices > 1 else ''} as queued "
        f"resource {name} in {zone}{' (spot)' if spot else ''}{' (reserved)' if reserved else ''}"
        f"; Ctrl-C stops waiting, the request stays ({delete} deletes it)")
    if not wait:
        return []
    return _wait_active(client, f"{parent}/queuedResources/{name}", delete, say)


def _wait_active(client, path: str, delete: str, say: Callable[[str], None]) -> list[str]:
    started, last = time.monotonic(), ""
    name = path.rsplit("/", 1)[1]
    try:
        while True:
            resource = client.get_queued_resource(name=path)
            state, failed = _state(resource)
            if state != last:
                last = state         # (before it is said: a Ctrl-C may come right after)
                say(f"{name}: {state} after {time.monotonic() - started:.0f} s")
            if state == "ACTIVE":
                return [i for spec in resource.tpu.node_spec for i in _node_ids(resource, spec)]
            if state == "FAILED":
                raise RemoteTPUError(f"queued resource {name} FAILED: {failed or 'no reason given'}"
                                     f" ({delete} removes it)")
            if state not in _WAITING:
                raise RemoteTPUError(f"queued resource {name} is {state}, not on its way to "
                                     f"ACTIVE ({delete} removes it)")
            time.sleep(_poll_seconds())
    except KeyboardInterrupt:
        say(f"stopped waiting; queued resource {name} stays {last or 'requested'}: {delete} "
            "deletes it")
        raise


def down(name: str, zone: str, project: str = "", say: Callable[[str], None] = print) -> None:
    """Delete the queued resource ``name`` and its nodes (or the node ``name``)."""
    client, project = _client_and_project(project)
    _, errors = _library()
    tpu_v2, _ = _library()
    parent = f"projects/{project}/locations/{zone}"
    try:
        client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
            name=f"{parent}/queuedResources/{name}", force=True)).result(timeout=600)
        say(f"deleted queued resource {name} and its nodes in {zone}")
        return
    except errors.NotFound:
        pass
    except errors.GoogleAPICallError as exc:
        raise _api_error(f"delete queued resource {name}", exc) from None
    try:
        client.delete_node(name=f"{parent}/nodes/{name}").result(timeout=600)
        say(f"deleted TPU node {name} in {zone} (it had no queued resource)")
    except errors.NotFound:
        raise RemoteTPUError(f"there is no queued resource or TPU node {name!r} in zone {zone} "
                             f"of project {project} (`remote-tpu slices --zone {zone}` lists "
                             "them)") from None
    except errors.GoogleAPICallError as exc:
        raise _api_error(f"delete TPU node {name}", exc) from None


def slices(zone: str, project: str = "", agent_port: int = DEFAULT_AGENT_PORT,
           probe: Callable[[str], str] | None = None) -> list[dict[str, Any]]:
    """The zone's queued resources and nodes: name, accelerator, state, the
    node's state and workers, and what answers on worker 0's agent port."""
    client, project = _client_and_project(project)
    _, errors = _library()
    parent = f"projects/{project}/locations/{zone}"
    try:
        resources = list(client.list_queued_resources(parent=parent))
        nodes = {n.name.rsplit("/", 1)[1]: n for n in client.list_nodes(parent=parent)}
    except errors.GoogleAPICallError as exc:
        raise _api_error(f"list the TPUs of {parent}", exc) from None
    probe = probe or _agent_answer
    rows, seen = [], set()
    for r in resources:
        state, failed = _state(r)
        for spec in r.tpu.node_spec:
            for node_id in _node_ids(r, spec):
                seen.add(node_id)
                rows.append(_row(node_id, r.name.rsplit("/", 1)[1], state, failed,
                                 nodes.get(node_id), spec.node.accelerator_type, agent_port,
                                 probe))
    for node_id, node in nodes.items():
        if node_id not in seen:
            rows.append(_row(node_id, "", "", "", node, node.accelerator_type, agent_port, probe))
    return rows


def _node_ids(resource, spec) -> list[str]:
    """The nodes a queued resource's node spec makes: its node id, or a
    multislice's PREFIX-0, PREFIX-1, ..."""
    if spec.node_id:
        return [spec.node_id]
    prefix = spec.multislice_params.node_id_prefix or resource.name.rsplit("/", 1)[1]
    return [f"{prefix}-{i}" for i in range(spec.multislice_params.node_count)]


def _row(node_id, queued, state, failed, node, accelerator, port, probe) -> dict[str, Any]:
    ips = [e.ip_address for e in node.network_endpoints] if node is not None else []
    node_state = node.state.name if node is not None else ""
    agent = probe(join_host_port(ips[0], port)) if ips and node_state == "READY" else ""
    return {"node": node_id, "queued_resource": queued, "queued_state": state,
            "failed": failed, "accelerator": f"tpu-{accelerator}" if accelerator else "",
            "node_state": node_state, "workers": ips, "agent": agent}


def _agent_answer(address: str) -> str:
    """What answers at ``address``: the agent's version, or why none."""
    from ._core.channels import Credentials, error_from_rpc, health
    from ._core.exceptions import AuthenticationError

    try:
        reply = health(address, Credentials.for_client(), attempts=1, timeout=3, shared=False)
    except Exception as exc:  # noqa: BLE001 - any failure: said, no agent to use
        err = error_from_rpc(exc, address) if hasattr(exc, "code") else exc
        if isinstance(err, AuthenticationError):
            return f"an agent at {address}, which refused this client's token"
        return f"no agent answering at {address}"
    return f"agent {reply.versions.remote_tpu} at {address}"


def print_slices(rows: list[dict[str, Any]], out=sys.stdout) -> None:
    if not rows:
        print("no queued resources or TPU nodes in this zone", file=out)
        return
    table = [("NAME", "ACCELERATOR", "QUEUED RESOURCE", "NODE", "WORKERS", "AGENT")]
    for r in rows:
        queued = f"{r['queued_resource']} {r['queued_state']}".strip() or "-"
        if r["failed"]:
            queued += f" ({r['failed']})"
        table.append((r["node"], r["accelerator"] or "-", queued, r["node_state"] or "-",
                      str(len(r["workers"])), r["agent"] or "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)
