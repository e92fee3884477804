"""requirements=: what both sides check of a job's requirement lines."""

from __future__ import annotations

import re
from collections.abc import Sequence

# What a job's environment may not replace unless told to: the TPU stack, and
# what must match the client (cloudpickle's format, remote_tpu's protocol).
PROTECTED = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "cloudpickle", "remote-tpu")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def protected(requirements: Sequence[str]) -> list[str]:
    """The requirement lines that name a PROTECTED distribution."""
    found = []
    for line in requirements:
        m = _NAME.match(line)
        if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() in PROTECTED:
            found.append(line.strip())
    return found


def refusal(bad: Sequence[str]) -> str:
    return (f"requirements {list(bad)} would replace the host's own jax, libtpu, cloudpickle "
            "or remote_tpu, which must match the TPU and the client; leave them out (the "
            "host's stay), or pass allow_jax_requirements=True")
