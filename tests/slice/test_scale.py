"""init_jax=False, and 64 hosts: a function that needs no JAX runs on every
host of a large local slice, every host's output comes back, and one failing
host among 64 is the one named."""

from __future__ import annotations

import os
import re

import pytest

import remote_tpu
from remote_tpu._local_slice import stop_local_slices

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BIG = "tpu-v4-512"          # 64 hosts x 4 chips


@pytest.fixture(scope="module")
def big_slice():
    yield
    stop_local_slices()


def test_init_jax_false_initializes_no_jax_distributed(big_slice):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts="local", init_jax=False, stream="none")
    def no_distributed():
        import sys
        jax = sys.modules.get("jax")      # a spare may have imported it ahead
        ours = jax is not None and "remote_tpu" in (jax.distributed.initialize.__doc__ or "")
        return ours, os.environ["REMOTE_TPU_HOST_INDEX"]

    assert no_distributed() == (False, "0")


def test_64_hosts_run_and_each_host_s_output_comes_back(big_slice, capfd):
    @remote_tpu.run(accelerator=BIG, hosts="local", init_jax=False, stream="all")
    def hello():
        import sys
        print(f"hello from {os.environ['REMOTE_TPU_HOST_INDEX']}")
        return int(os.environ["REMOTE_TPU_NUM_HOSTS"]), "jax" in sys.modules

    assert hello() == (64, False)        # light spares on so large a local slice: no jax
    out = capfd.readouterr().out
    said = {int(h): int(i) for h, i in re.findall(r"\[host (\d+)\] hello from (\d+)", out)}
    assert said == {i: i for i in range(64)}


def test_one_failing_host_among_64_is_named(big_slice):
    @remote_tpu.run(accelerator=BIG, hosts="local", init_jax=False, stream="none")
    def one_fails():
        if os.environ["REMOTE_TPU_HOST_INDEX"] == "37":
            raise KeyError("host 37's own failure")
        import time
        time.sleep(60)          # the others are stopped: fail-fast

    with pytest.raises(KeyError, match="host 37's own failure") as failed:
        one_fails()
    assert getattr(failed.value, "remote_host", None) == 37


def test_init_jax_must_be_a_bool():
    with pytest.raises(remote_tpu.ConfigurationError, match="init_jax= must be True or False"):
        remote_tpu.run(accelerator="tpu-v4-8", hosts="local", init_jax="no")
