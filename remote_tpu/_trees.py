"""A call's trees in the agents' argument cache: its ``working_dir=`` and its
local ``remote_tpu.Data`` directories and files (``_workdir``, ``_data``).

They must all stay in the cache at once, beside the call's own large
buffers (``_blobs``), from when they are sent until the call starts on every
host: the cache evicts the least recently used, so what does not fit beside
the rest pushes an earlier part out, and the call would fail every time. So
their total is checked against the gateway's cache before anything is sent,
the call's own buffers go inside its payload where they would not fit beside
the trees, and trees that cannot fit at all are refused with what to raise.
"""

from __future__ import annotations

import dataclasses

from . import _blobs, _workdir
from ._core.exceptions import ConfigurationError
from ._core.proto import remote_tpu_pb2 as pb
from ._target import Target


@dataclasses.dataclass
class Trees:
    """The trees of one call (each a description and its buffers), and the
    gs:// URIs its hosts fetch."""
    root: str = ""                                    # working_dir, or ""
    working_dir: tuple | None = None                  # (pb.WorkingDir, buffers)
    data: list[tuple] = dataclasses.field(default_factory=list)
    gcs: list[str] = dataclasses.field(default_factory=list)

    def nbytes(self) -> int:
        """The bytes they take in the cache (a buffer they share counted once)."""
        trees = ([self.working_dir] if self.working_dir else []) + self.data
        return sum({b.digest: b.size for tree, _ in trees for b in tree.blobs}.values())


def prepare(target: Target, working_dir: str, payload) -> Trees:
    """The call's trees: described, local Data staged to GCS where asked (unless
    there already), and checked to fit the gateway's argument cache together.
    Nothing of them is sent yet (``send``)."""
    trees = Trees(root=working_dir)
    if working_dir:
        trees.working_dir = _workdir.describe(working_dir)
    met = getattr(payload, "data", None)
    if met is not None:
        if met.staged:
            from ._data import stage
            for data, where in met.staged:
                stage(data, where)
        trees.data = list(met.trees)
        trees.gcs = list(dict.fromkeys(met.gcs))
    need = trees.nbytes()
    if need:
        _check_room(target, trees, need, _blobs.capacity(target))
    return trees


def _check_room(target: Target, trees: Trees, need: int, capacity: int) -> None:
    if need <= capacity:
        return
    parts = []
    if trees.working_dir:
        parts.append(f"working_dir {trees.root} ({_workdir._human(_size(trees.working_dir))})")
    if trees.data:
        parts.append(f"{len(trees.data)} local remote_tpu.Data argument(s) "
                     f"({_workdir._human(sum(_size(t) for t in trees.data))})")
    has = (f"holds at most {capacity:,} bytes (--cache-bytes {capacity:,})" if capacity else
           "keeps none (--cache-bytes 0)")
    fixes = [f"start the agents with --cache-bytes {need} or more"]
    if trees.working_dir:
        fixes.append("make working_dir smaller with a .remote_tpu_ignore")
    if trees.data:
        fixes.append("pass staging='gs://bucket/prefix' to run() (or to remote_tpu.Data) "
                     "so that local data goes through a bucket")
    raise ConfigurationError(
        f"{' and '.join(parts)} need {need:,} bytes in the argument cache of the agent at "
        f"{target.gateway} all at once, and it {has}: nothing was sent. To run it, "
        f"{', or '.join(fixes)}")


def _size(tree: tuple) -> int:
    return sum({b.digest: b.size for b in tree[0].blobs}.values())


def send(target: Target, trees: Trees) -> tuple[pb.WorkingDir | None, list[pb.WorkingDir]]:
    """Make sure the gateway holds every buffer of the trees (sending what it
    lacks); their descriptions, for the job spec."""
    for what, tree in ([(f"working_dir {trees.root}", trees.working_dir)]
                       if trees.working_dir else []) + \
            [("a remote_tpu.Data argument", t) for t in trees.data]:
        description, buffers = tree
        why = buffers and _blobs.send_buffers(target, list(description.blobs),
                                              [b.data for b in buffers])
        if why:
            raise ConfigurationError(
                f"the agent at {target.gateway} cannot keep {what} "
                f"({_workdir._human(_size(tree))}) in its argument cache: {why}")
    return (trees.working_dir[0] if trees.working_dir else None,
            [description for description, _ in trees.data])
