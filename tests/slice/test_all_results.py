"""all_results=: every process's return value, a list in process order, on
two real agents with two processes each (real multi-process JAX on CPU)."""

from __future__ import annotations

import pytest

import remote_tpu
from remote_tpu._core.limits import INLINE_BYTES, OTHER_VALUE_BYTES
from remote_tpu._core.serialization import SerializationError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _on(agents, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, processes_per_host=2, stream="none", **kw)


def _report(size: int):
    """Each process's own report: which process, on which host, and ``size``
    bytes (0, a few, or more than fits inline: a file on both sides)."""
    import os

    import jax
    return {"process": jax.process_index(), "host": os.environ["REMOTE_TPU_HOST_INDEX"],
            "blob": bytes([jax.process_index()]) * size}


def _check(values: list, size: int) -> None:
    assert [v["process"] for v in values] == [0, 1, 2, 3]
    assert [v["host"] for v in values] == ["0", "0", "1", "1"]
    assert [v["blob"] for v in values] == [bytes([i]) * size for i in range(4)]


@pytest.mark.parametrize("size", [0, 1, INLINE_BYTES + 1], ids=["empty", "1-byte", "file"])
def test_every_process_value_comes_back_in_process_order(agents, size):
    _check(_on(agents, all_results=True)(_report)(size), size)


def test_warm_calls_and_handles_get_every_value_too(agents):
    step = _on(agents, all_results=True, keep_warm=60)(_report)
    try:
        for size in (3, INLINE_BYTES * 3):           # the second call on the lane
            _check(step(size), size)
        _check(step.submit(5).result(timeout=120), 5)
    finally:
        step.release()


def test_without_it_only_process_0s_value_comes_back(agents):
    assert _on(agents)(_report)(2)["process"] == 0


def test_a_value_over_the_bound_fails_its_process_and_says_what_to_do(agents):
    @_on(agents, all_results=True)
    def big():
        import jax
        return b"x" * (OTHER_VALUE_BYTES + 1) if jax.process_index() == 3 else 0

    with pytest.raises(SerializationError) as info:
        big()
    text = str(info.value)
    assert "process 3's return value" in text and f"{OTHER_VALUE_BYTES:,}" in text, text
    assert "return a summary" in text, text
