"""``all_results=``: the job's value is every process's, joined in process
order as ``remote_tpu._core.value_list`` lays them out, without reading them:
in memory when small, else in a file of the job's directory."""

from __future__ import annotations

import os
from collections.abc import Sequence

from remote_tpu._core import digests, value_list
from remote_tpu._core.limits import CHUNK_SIZE, INLINE_BYTES

from remote_tpu_agent.worker.handle import ProcessHandle

JOINED_FILE = "all_results.bin"


class Joined:
    """The joined value: ``data`` (inline) or ``path``, and its ``digest``."""

    def __init__(self, data: bytes | None, path: str, digest: bytes) -> None:
        self.data = data
        self.path = path
        self.digest = digest


def join(handles: Sequence[ProcessHandle], job_dir: str) -> Joined | str:
    """Every process's value joined; or why it cannot be (a value missing)."""
    values = []
    for h in sorted(handles, key=lambda h: h.host):
        value = h.pickled_value()
        if value is None:
            return (f"process {h.host}'s return value did not reach the gateway "
                    "(all_results=); the job's value cannot be made")
        values.append(value)
    lengths = [len(v) if isinstance(v, bytes) else os.path.getsize(v) for v in values]
    head = value_list.header(lengths)
    digest = digests.new()
    digest.update(head)
    if sum(lengths) <= INLINE_BYTES and all(isinstance(v, bytes) for v in values):
        data = head + b"".join(values)            # type: ignore[arg-type]
        return Joined(data, "", digests.of(data))
    path = os.path.join(job_dir, JOINED_FILE)
    os.makedirs(job_dir, mode=0o700, exist_ok=True)
    with open(path, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as out:
        out.write(head)
        for value in values:
            for chunk in _chunks(value):
                digest.update(chunk)
                out.write(chunk)
    return Joined(None, path, digest.digest())


def _chunks(value: bytes | str):
    if isinstance(value, bytes):
        yield value
        return
    with open(value, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            yield chunk
