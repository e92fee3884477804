"""GCS for remote_tpu.Data: a host's local copies of gs:// data (fetched by
the worker before it unpickles a call), and what both sides say of a failure.

A host keeps each URI's copy in a directory of its own (under
``$REMOTE_TPU_GCS_CACHE``, set by its agent), with what it downloaded (each
object's size and generation): a later call downloads only objects that are
new or changed, and removes those gone from the bucket. The processes of one
host take turns (a file lock). The ``KEEP`` URIs used last stay. Downloads and
uploads run in parallel threads (``transfer_manager``), each with the
library's own retry of transient errors. (Local data staged to a bucket by the
client: ``remote_tpu._data.stage``.)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile

from . import digests
from .dirs import make_private, prune_oldest
from .exceptions import ConfigurationError
from .local_names import UnsafeName, local_path

KEEP = 8
THREADS = 8


def client():
    from google.cloud import storage
    return storage.Client()


def split(uri: str) -> tuple[str, str]:
    bucket, _, name = uri[len("gs://"):].partition("/")
    return bucket, name


def failure(exc: Exception, uri: str, need: str, otherwise: str = "see the error above"
            ) -> str:
    """What a storage call on ``uri`` that needed permission ``need`` ran into,
    and what to do: a missing bucket, a missing permission, no credentials."""
    code = getattr(exc, "code", None)
    bucket = split(uri)[0]
    text = str(getattr(exc, "message", "") or exc).splitlines()[0][:300]
    if code == 403:
        hint = f"these credentials lack {need} on bucket {bucket}"
    elif code == 404:
        hint = f"bucket {bucket} does not exist"
    elif code == 401 or "credentials" in text.lower():
        hint = "no Google Cloud credentials here (application default credentials)"
    else:
        hint = otherwise
    return f"{type(exc).__name__}: {text}; {hint}"


def explain(exc: Exception, uri: str, need: str) -> ConfigurationError:
    return ConfigurationError(f"{uri}: {failure(exc, uri, need)}")


def local_copy(uri: str) -> str:
    """The path of this host's copy of ``uri`` (a file for one object, else a
    directory of every object under it), brought up to date first."""
    from google.cloud.storage import transfer_manager

    cache = os.environ.get("REMOTE_TPU_GCS_CACHE") or os.path.join(
        tempfile.gettempdir(), f"remote_tpu-gcs-{os.getuid()}")
    root = os.path.join(cache, digests.of(uri.encode()).hex()[:24])
    make_private(root)
    bucket_name, name = split(uri)
    with open(root + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            gcs = client()
            blobs = list(gcs.list_blobs(bucket_name, prefix=name))
        except Exception as exc:  # noqa: BLE001 - named, with what to do
            raise explain(exc, uri, "storage.objects.list") from None
        exact = [b for b in blobs if b.name == name]
        tree = os.path.join(root, "tree")
        single = bool(exact) and not name.endswith("/")
        if single:
            want = {os.path.basename(name): exact[0]}
        else:
            under = name.rstrip("/") + "/" if name else ""
            want = {b.name[len(under):]: b for b in blobs
                    if b.name.startswith(under) and not b.name.endswith("/")}
        if not want:
            raise FileNotFoundError(f"{uri}: no such object, and no objects under it")
        paths = _local_paths(uri, tree, want)
        result = paths[os.path.basename(name)] if single else tree
        try:
            with open(os.path.join(root, "manifest.json")) as f:
                had = json.load(f)
        except (OSError, ValueError):
            had = {}
        todo = [(rel, blob) for rel, blob in want.items()
                if had.get(rel) != [blob.size, blob.generation] or
                not os.path.isfile(paths[rel])]
        pairs = []
        for rel, blob in todo:
            make_private(os.path.dirname(paths[rel]))
            pairs.append((blob, paths[rel]))
        try:
            transfer_manager.download_many(pairs, max_workers=THREADS,
                                           worker_type=transfer_manager.THREAD,
                                           raise_exception=True)
        except Exception as exc:  # noqa: BLE001
            raise explain(exc, uri, "storage.objects.get") from None
        for directory, _, files in os.walk(tree):        # gone from the bucket: gone here
            for f in files:
                rel = os.path.relpath(os.path.join(directory, f), tree).replace(os.sep, "/")
                if rel not in want:
                    os.unlink(os.path.join(directory, f))
        with open(os.path.join(root, "manifest.json"), "w") as f:
            json.dump({rel: [b.size, b.generation] for rel, b in want.items()}, f)
        os.utime(root)
    prune_oldest(cache, KEEP, {root}, _remove)
    return result


def _local_paths(uri: str, tree: str, want: dict) -> dict[str, str]:
    """Where each wanted object (by its name below ``uri``) goes in ``tree``;
    every name is checked before anything is downloaded: a bucket's objects
    may be named to land elsewhere (``data//home/u/.bashrc``, ``data/../x``)."""
    paths = {}
    for rel, blob in want.items():
        try:
            paths[rel] = local_path(tree, rel)
        except UnsafeName as exc:
            raise ConfigurationError(
                f"{uri}: cannot save the object {f'gs://{blob.bucket.name}/{blob.name}'!r} in "
                f"this host's copy: its name below the prefix, {exc}. Rename or remove that "
                "object, or point remote_tpu.Data at a prefix without it; nothing was "
                "downloaded") from None
    return paths


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.unlink(path + ".lock")
    except OSError:
        pass
