"""output_dir=: a job's output files, from inside the function and from the client.

Inside the function, ``output_dir()`` is the directory this process writes
to. On the client, a job's files are listed in GCS, or (``output_dir=`` a
local directory) collected from every host through the gateway into
``{output_dir}/{job_id}/``: process i's own files under ``host_{i}/``, the
shared ones at the top.
"""

from __future__ import annotations

import os
import sys

from ._core.exceptions import ConfigurationError
from ._core.local_names import RULE, UnsafeName, local_path, problem

_OWN, _SHARED = "REMOTE_TPU_OUTPUT_DIR", "REMOTE_TPU_SHARED_OUTPUT_DIR"


def output_dir(shared: bool = False) -> str:
    """Inside a function run with ``output_dir=``: the local directory this
    process writes its outputs to (saved under ``host_{i}/``), or with
    ``shared=True`` the job's shared one on this host (saved at the top of the
    job's outputs; the same name written on two hosts: the last saved wins)."""
    path = os.environ.get(_SHARED if shared else _OWN, "")
    if not path or "://" in path or not os.path.isdir(path):
        raise ConfigurationError(
            "remote_tpu.output_dir() is for a function running on a slice with "
            "output_dir= set, e.g. @remote_tpu.run(..., output_dir='gs://bucket/runs')")
    return path


def _local_path(root: str, rel: str) -> str:
    """Where the job's file ``rel`` (as its agent names it) goes under
    ``root``: the shared ones at the top. UnsafeName where it may not."""
    why = problem(rel)
    if why:
        raise UnsafeName(rel, why)
    parts = rel.split("/")
    return local_path(root, "/".join(parts[1:]) if parts[0] == "shared" else rel)


def collect(target, job_id: str, destination: str) -> list[str]:
    """Bring a finished job's output files from every host to
    ``{destination}/{job_id}/``; their paths. Problems are said on stderr."""
    from ._core.proto import remote_tpu_pb2 as pb

    root = os.path.join(destination, job_id)
    written: list[str] = []
    problems: list[str] = []
    current, out = "", None
    try:
        stream = target.stub().OutputFiles(pb.OutputsRequest(job_id=job_id),
                                           metadata=target.credentials.metadata,
                                           timeout=3600)
        for chunk in stream:
            if chunk.error:
                problems.append(chunk.error)
                continue
            if chunk.path != current or chunk.offset == 0:
                if out is not None:
                    out.close()
                out, current = _open(root, chunk.path, written, problems), chunk.path
            if out is not None:
                out.write(chunk.data)
    except Exception as exc:  # noqa: BLE001 - the job's own outcome matters more
        details = exc.details() if hasattr(exc, "details") else exc
        problems.append(f"could not collect them: {type(exc).__name__}: {details}")
    finally:
        if out is not None:
            out.close()
    for said in problems:
        print(f"remote_tpu: job {job_id}'s output files: {said}", file=sys.stderr,
              flush=True)
    return sorted(set(written))


def _open(root: str, rel: str, written: list[str], problems: list[str]):
    """The local file for the job's file ``rel``, open to write (its path added
    to ``written``); None, and why in ``problems``, where its name may not be."""
    try:
        path = _local_path(root, rel)
    except UnsafeName as exc:
        problems.append(f"skipped the output file {rel!r}: its name {exc.why} (allowed: "
                        f"{RULE}); write it under another name to collect it")
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    written.append(path)
    return open(path, "wb")


def list_gcs(uri: str, job_id: str) -> list[str]:
    """The objects a job wrote under ``{uri}/{job_id}/``."""
    from google.cloud import storage

    bucket, _, prefix = uri[len("gs://"):].partition("/")
    under = "/".join(p for p in (prefix.strip("/"), job_id) if p) + "/"
    try:
        names = [b.name for b in storage.Client().list_blobs(bucket, prefix=under)]
    except Exception as exc:  # noqa: BLE001 - said with the bucket and what to do
        raise ConfigurationError(f"cannot list gs://{bucket}/{under}: {exc} (this machine "
                                 "needs Google Cloud credentials that may read the bucket: "
                                 "gcloud auth application-default login)") from None
    return sorted(f"gs://{bucket}/{name}" for name in names)
