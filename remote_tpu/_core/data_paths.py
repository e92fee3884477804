"""On a worker: where this call's local remote_tpu.Data trees were placed on
its host (a tree's digest, hex -> the path of its copy), set by the worker
before it unpickles the call (``remote_tpu._data`` reads it); and its local copies of gs:// data, which
the worker fetched before it unpickled the call."""

placed: dict[str, str] = {}
fetched: dict[str, str] = {}     # a gs:// URI -> this host's copy of it


def fetch(uri: str) -> str:
    """This host's up-to-date copy of a gs:// object or prefix."""
    from .gcs import local_copy
    return local_copy(uri)
