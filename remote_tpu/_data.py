"""remote_tpu.Data: a file or directory the function gets as a local path on
every host.

``Data("some/local/dir")`` travels by content, like ``working_dir=``
(``_workdir``): its files go through the agents' argument cache, sent only to
hosts that lack them, and every host writes it once and hands the function the
path of its copy. ``Data("gs://bucket/prefix")`` (an object, or every object
under a prefix) is downloaded by each host itself, in parallel, into a cache
of its own that keeps what has not changed since. With ``staging=`` (or
``REMOTE_TPU_STAGING``) local data goes to GCS once, under its digest, and
every host downloads it from there: what you want when the client sits
behind a slow link and the slice is in the cloud.

On the client, a ``Data`` is also a path (``os.fspath``), so ``fn.local(...)``
works unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading

from ._core.exceptions import ConfigurationError

_collecting = threading.local()      # what pickling a call met: see ``collecting``


class Data:
    """A file or directory (local, or ``gs://bucket/path``) that the function
    receives as the local path of its copy on each host (a ``str``)."""

    def __init__(self, path_or_uri: str | os.PathLike, *, staging: str | None = None) -> None:
        if not isinstance(path_or_uri, (str, os.PathLike)):
            raise ConfigurationError(f"remote_tpu.Data takes a path or a gs:// URI, got "
                                     f"{path_or_uri!r}")
        text = os.fspath(path_or_uri)
        if staging is not None and not str(staging).startswith("gs://"):
            raise ConfigurationError(f"staging={staging!r}: give a gs://bucket/prefix")
        self.staging = staging
        if text.startswith("gs://"):
            if not text[len("gs://"):].split("/", 1)[0]:
                raise ConfigurationError(f"remote_tpu.Data({text!r}): no bucket named")
            self.uri, self.path = text, ""
            return
        if "://" in text:
            raise ConfigurationError(f"remote_tpu.Data({text!r}): only local paths and "
                                     "gs:// URIs are supported")
        self.uri, self.path = "", os.path.abspath(os.path.expanduser(text))
        if not os.path.exists(self.path):
            raise ConfigurationError(f"remote_tpu.Data({text!r}): {self.path} does not exist")

    def __repr__(self) -> str:
        return f"remote_tpu.Data({self.uri or self.path!r})"

    def __fspath__(self) -> str:
        if self.uri:
            raise ConfigurationError(f"{self!r} is a path only on the slice's hosts")
        return self.path

    def _tree(self):
        """(description, buffers, name of the file or "") of local data."""
        from . import _workdir

        if os.path.isdir(self.path):
            tree, buffers = _workdir.describe(self.path, limit=None,
                                              files=_workdir.scan(self.path, ignore=False))
            return tree, buffers, ""
        name = os.path.basename(self.path)
        one = _workdir._File.of(name, self.path, os.stat(self.path))
        tree, buffers = _workdir.describe(os.path.dirname(self.path), limit=None, files=[one])
        return tree, buffers, name

    def __reduce__(self):
        met = getattr(_collecting, "met", None)
        if self.uri:
            if met is not None:
                met.gcs.append(self.uri)
            return _gcs_path, (self.uri,)
        if met is None:
            raise ConfigurationError(f"{self!r} can only be pickled as an argument of a "
                                     "remote_tpu function")
        tree, buffers, name = self._tree()
        staging = self.staging or met.staging
        if staging:
            where = f"{staging.rstrip('/')}/{tree.digest.hex()}"
            met.staged.append((self, where))
            met.gcs.append(f"{where}/{name}" if name else where)
            return _gcs_path, (met.gcs[-1],)
        met.trees.append((tree, buffers))
        return _placed_path, (tree.digest.hex(), name)


class _Met:
    def __init__(self, staging: str) -> None:
        self.staging = staging
        self.trees: list = []        # (WorkingDir, buffers) to send through the cache
        self.staged: list = []       # (Data, gs:// prefix) to upload to the staging bucket
        self.gcs: list[str] = []     # gs:// URIs every host fetches before unpickling


@contextlib.contextmanager
def collecting(staging: str = ""):
    """While pickling a call: the ``Data`` arguments it holds, met as pickled."""
    met = _Met(staging)
    _collecting.met = met
    try:
        yield met
    finally:
        _collecting.met = None


def _placed_path(digest_hex: str, name: str) -> str:
    """On a host: the path of local data its agent placed for this call."""
    from ._core.data_paths import placed

    root = placed.get(digest_hex)
    if root is None:
        raise RuntimeError(f"remote_tpu.Data {digest_hex[:12]} was not placed on this host "
                           "(it is only available inside the call that passed it)")
    return os.path.join(root, name) if name else root


def _gcs_path(uri: str) -> str:
    """On a host: the local copy of a gs:// object or prefix, fetched by the
    worker before it unpickled the call (else now: ``_gcs_cache``)."""
    from ._core.data_paths import fetched

    if uri in fetched:
        return fetched[uri]
    from ._core.gcs import local_copy
    return local_copy(uri)


def stage(data, where: str) -> None:
    """Upload local ``data`` (a ``Data``) to ``where`` (``gs://bucket/prefix``,
    named by its digest) unless it is there already (``{where}.complete``)."""
    from google.cloud.storage import transfer_manager

    from . import _workdir
    from ._core.gcs import THREADS, client, explain, split

    bucket_name, prefix = split(where)
    try:
        bucket = client().bucket(bucket_name)
        marker = bucket.blob(prefix + ".complete")
        if marker.exists():
            return
        if os.path.isdir(data.path):
            files = [(f.path, f.rel) for f in _workdir.scan(data.path, ignore=False)]
        else:
            files = [(data.path, os.path.basename(data.path))]
        results = transfer_manager.upload_many(
            [(path, bucket.blob(f"{prefix}/{rel}")) for path, rel in files],
            max_workers=THREADS, worker_type=transfer_manager.THREAD, raise_exception=True)
        del results
        marker.upload_from_string(b"")
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, where, "storage.objects.create") from None
