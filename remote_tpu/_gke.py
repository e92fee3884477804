"""``remote-tpu gke manifest``: the Kubernetes objects that run an agent in
every pod of a TPU slice on GKE, and the Dockerfile of the agent's image.

What each piece follows (public documentation; nothing here is copied):

- a JobSet (https://jobset.sigs.k8s.io) with one replicated job per slice:
  ``replicas`` = the number of slices, each an Indexed Job of one pod per TPU
  VM, all pods started at once; ``network.enableDNSHostnames`` gives every pod
  the hostname ``<jobset>-slice-<slice>-<worker>.<jobset>``, which GKE lists
  in ``TPU_WORKER_HOSTNAMES`` (and, for TPU7x, ``TPU_PROCESS_ADDRESSES``);
- the annotation ``alpha.jobset.sigs.k8s.io/exclusive-topology:
  cloud.google.com/gke-nodepool``: each slice's pods on one node pool (one TPU
  slice) of their own;
- GKE's TPU node selectors ``cloud.google.com/gke-tpu-accelerator`` and
  ``cloud.google.com/gke-tpu-topology``, and ``google.com/tpu`` chips per pod:
  every chip of its VM (https://cloud.google.com/kubernetes-engine/docs/how-to/tpus);
  on TPU7x the one agent of a VM runs its two JAX processes itself;
- Kueue's ``kueue.x-k8s.io/queue-name`` label, where a queue is given;
- one Service per slice selecting its worker 0 (the gateway), which clients in
  the cluster reach by name and ``kubectl port-forward`` reaches from outside;
- the slice token from a Kubernetes Secret, mounted as a file readable by its
  owner only, as the agent demands of a token file.

The manifest is written as JSON, a ``v1`` ``List`` of those objects: JSON is
YAML, ``kubectl apply -f`` takes it, and the client needs no YAML library.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from ._core.addresses import DEFAULT_AGENT_PORT
from ._core.exceptions import ConfigurationError
from ._core.topology import Topology
from ._core.versions import __version__

TOKEN_DIR = "/etc/remote-tpu"
TOKEN_KEY = "token"
REPLICATED_JOB = "slice"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Labels JobSet and Indexed Jobs put on every pod (https://jobset.sigs.k8s.io,
# https://kubernetes.io/docs/concepts/workloads/controllers/job/#completion-mode).
_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# A DNS-1035 label, short enough that "<name>-slice-<i>-<j>-<suffix>" stays one.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def _check_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise ConfigurationError(
            f"{what} {value!r} is not a Kubernetes name this manifest can use: lowercase "
            "letters, digits and '-', starting with a letter, at most 40 characters "
            "(e.g. 'train-v5p')")
    return value


def _gke_topology(accelerator: str) -> Topology:
    topology = Topology.parse(accelerator)
    if not topology.gke_accelerator:
        raise ConfigurationError(
            f"{topology.name}: GKE offers no {topology.generation} slices; use a v4, v5p, "
            "v5e (v5litepod), v6e or tpu7x accelerator, e.g. tpu-v5p-32 or tpu7x-32")
    return topology


def gateway_service(name: str, slice_index: int = 0) -> str:
    """The Service in front of a slice's worker 0."""
    return f"{name}-gateway" if slice_index == 0 else f"{name}-gateway-{slice_index}"


def manifest(accelerator: str, *, name: str = "remote-tpu", num_slices: int = 1,
             image: str = "", queue: str = "", port: int = DEFAULT_AGENT_PORT,
             token_secret: str = "remote-tpu-token") -> dict[str, Any]:
    """The objects that run one agent per TPU VM of ``num_slices`` slices of
    ``accelerator``, as one ``v1`` ``List``; see the module docstring."""
    topology = _gke_topology(accelerator)
    _check_name(name, "--name")
    _check_name(token_secret, "--token-secret")
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise ConfigurationError(f"--num-slices {num_slices!r}: give a whole number of "
                                 "slices, 1 or more")
    if not 0 < port < 65536:
        raise ConfigurationError(f"--port {port}: give a port from 1 to 65535")
    if queue and not _LABEL_VALUE.match(queue):
        raise ConfigurationError(
            f"--queue {queue!r} is not a Kubernetes label value (letters, digits, '-', "
            "'_', '.', at most 63): give the name of a Kueue LocalQueue")
    image = image or f"remote-tpu-agent:{__version__}"
    if not image.strip() or any(c.isspace() for c in image):
        raise ConfigurationError(f"--image {image!r}: give an image reference, e.g. "
                                 "us-docker.pkg.dev/PROJECT/REPO/remote-tpu-agent:TAG")
    items: list[dict[str, Any]] = [_jobset(topology, name, num_slices, image, queue, port,
                                           token_secret)]
    items += [_service(name, i, port) for i in range(num_slices)]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def _jobset(topology: Topology, name: str, num_slices: int, image: str, queue: str,
            port: int, token_secret: str) -> dict[str, Any]:
    # Each slice's pods on a node pool (one TPU slice) of their own.
    exclusive = {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    metadata: dict[str, Any] = {"name": name, "annotations": exclusive}
    if queue:
        metadata["labels"] = {QUEUE_LABEL: queue}
    job = {
        "parallelism": topology.hosts, "completions": topology.hosts,
        "completionMode": "Indexed", "backoffLimit": 0,
        "template": {"metadata": {"labels": {"app.kubernetes.io/name": "remote-tpu-agent"}},
                     "spec": _pod_spec(topology, image, port, token_secret)},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata,
        "spec": {
            "network": {"enableDNSHostnames": True},
            # An agent that stops ends its slice's Job: every agent is started
            # again (each one's place comes from GKE's variables anew).
            "failurePolicy": {"maxRestarts": 3},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": num_slices,
                                "template": {"spec": job}}],
        },
    }


def _pod_spec(topology: Topology, image: str, port: int, token_secret: str) -> dict[str, Any]:
    chips = str(topology.chips_per_host)
    return {
        "restartPolicy": "Never",
        "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": topology.gke_accelerator,
                         "cloud.google.com/gke-tpu-topology": topology.topology_label},
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "volumes": [{"name": "token", "secret": {"secretName": token_secret,
                                                 "defaultMode": 0o400}}],
        "containers": [{
            "name": "agent",
            "image": image,
            "args": ["--host", "0.0.0.0", "--port", str(port), "--insecure",
                     "--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}"],
            "ports": [{"name": "agent", "containerPort": port}],
            "resources": {"requests": {"google.com/tpu": chips},
                          "limits": {"google.com/tpu": chips}},
            "volumeMounts": [{"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}],
        }],
    }


def _service(name: str, slice_index: int, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": gateway_service(name, slice_index)},
        "spec": {
            "selector": {_JOBSET_NAME: name, _JOB_INDEX: str(slice_index),
                         _COMPLETION_INDEX: "0"},
            "ports": [{"name": "agent", "port": port, "targetPort": port}],
        },
    }


def _jax_requirement() -> str:
    """``jax[tpu]`` at the client's own jax version where it has one: the
    envelope of every call records it, and equal versions need no warning."""
    from importlib import metadata

    try:
        return f"jax[tpu]=={metadata.version('jax')}"
    except metadata.PackageNotFoundError:
        return "jax[tpu]"


def dockerfile(wheel: str, port: int = DEFAULT_AGENT_PORT) -> str:
    """The agent's image: this Python's minor version (cloudpickle ships
    functions by value between equal versions), this client's own remote-tpu
    (``wheel``, a file beside the Dockerfile: ``_wheel``) and ``jax[tpu]``."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"""\
# The remote-tpu agent, for the pods of `remote-tpu gke manifest`.
# Python {python}, as the client that wrote this file: functions travel by value
# between equal Python versions. {wheel} is that client's own remote-tpu.
FROM python:{python}-slim
COPY {wheel} /tmp/
RUN pip install --no-cache-dir "/tmp/{wheel}" "{_jax_requirement()}" && rm "/tmp/{wheel}"
EXPOSE {port}
# The pod's arguments (--host 0.0.0.0 --port ... --token-file ...) follow.
ENTRYPOINT ["remote-tpu-agent"]
"""


def write(out_dir: str, objects: dict[str, Any], port: int = DEFAULT_AGENT_PORT) -> list[str]:
    """``jobset.json``, the client's wheel and a ``Dockerfile`` that installs
    it, in ``out_dir`` (made if missing)."""
    from ._wheel import client_wheel

    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):         # a wheel of an earlier version: not in the image
        if old.startswith("remote_tpu-") and old.endswith(".whl"):
            os.remove(os.path.join(out_dir, old))
    wheel, _ = client_wheel(out_dir)
    paths = [os.path.join(out_dir, "jobset.json"), os.path.join(out_dir, "Dockerfile")]
    for path, text in zip(paths, (to_json(objects),
                                  dockerfile(os.path.basename(wheel), port))):
        with open(path, "w") as f:
            f.write(text)
    return [paths[0], wheel, paths[1]]


def to_json(objects: dict[str, Any]) -> str:
    return json.dumps(objects, indent=2) + "\n"
