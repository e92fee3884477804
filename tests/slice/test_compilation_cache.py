"""JAX's persistent compilation cache on every host (compilation_cache=): a
second cold call of the same jitted function finds its executable there, on
two real agents with real multi-process JAX on CPU."""

from __future__ import annotations

import os

import pytest

import remote_tpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Small programs compile in milliseconds here; jax caches only those that took
# longer than this (1 s by default, as on a TPU a real model's do).
CACHE_ALL = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _compile_once():
    """Jit one function; how many of its compilations the persistent cache
    answered (hits) or not (misses), on this host, and where the cache is."""
    import os

    import jax
    import jax.numpy as jnp
    from jax import monitoring

    seen = {"hits": 0, "misses": 0}

    def count(event: str, **_: object) -> None:
        for kind in seen:
            if event == f"/jax/compilation_cache/cache_{kind}":
                seen[kind] += 1

    monitoring.register_event_listener(count)
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 1)(jnp.arange(7.0)).block_until_ready()
    return seen, os.environ.get("JAX_COMPILATION_CACHE_DIR", "")


def _on(agents, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, env=CACHE_ALL, **kw)(_compile_once)


def _files(path: str) -> list[str]:
    return [f for _, _, files in os.walk(path) for f in files]


def test_the_second_cold_call_finds_its_executable_in_the_agents_cache(agents):
    first, where = _on(agents)()
    assert first["misses"] >= 1 and first["hits"] == 0, first
    assert where == os.path.join(agents.state_dirs[0], "compilation-cache"), where
    assert _files(where), "nothing was written to the cache"
    again, _ = _on(agents)()                   # new workers: a cold call
    assert again["hits"] >= 1 and again["misses"] == 0, again


def test_a_place_of_the_callers_own_or_none(agents, tmp_path):
    mine = str(tmp_path / "cache")
    first, where = _on(agents, compilation_cache=mine)()
    assert where == mine and first["misses"] >= 1 and _files(mine)
    assert _on(agents, compilation_cache=mine)()[0]["hits"] >= 1
    off, _ = _on(agents, compilation_cache=False)()
    off_again, _ = _on(agents, compilation_cache=False)()
    assert off == off_again == {"hits": 0, "misses": 0}, (off, off_again)

