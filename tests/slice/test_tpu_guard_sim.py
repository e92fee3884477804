"""A simulated slice uses no TPU: its agents never look at, remove or kill for
the machine's real TPU lock and devices (issue item 11). A real agent still does."""

from __future__ import annotations

import threading
import time

import pytest

import remote_tpu
from conftest import Agents, hold_open, kill_process

pytestmark = pytest.mark.timeout(120)


def _agent(tpu_files, simulate: int, *extra: str) -> Agents:
    lock, device = tpu_files
    return Agents(1, devices=simulate, peers=False,
                  extra=["--tpu-lockfile", str(lock),
                         "--tpu-devices", str(device.parent / "accel*"), *extra])


# ------------------------------------------------------------ the guard itself


    # (That a real agent refuses a live foreign holder is tested end to end below:
    # here the holder is this test's child, which a guard in this process owns.)


# ------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_simulated_agent_runs_while_the_real_tpu_is_locked(tpu_files):
    """Fails until the agent (server.parts) builds its guard with TpuGuard.for_agent."""
    lock, device = tpu_files
    # --kill-tpu-holders too: even then a simulated agent must not touch the holders.
    agents = _agent(tpu_files, 2, "--kill-tpu-holders")
    lock_holder = hold_open(str(lock))
    device_holder = hold_open(str(device))
    try:
        @remote_tpu.run(accelerator="tpu-v4-8", hosts=agents.addresses[0],
                        token=agents.token)
        def devices():
            import jax
            return jax.device_count(), jax.devices()[0].platform

        assert devices() == (2, "cpu")
        assert lock_holder.poll() is None and device_holder.poll() is None, \
            "a simulated agent killed the real TPU's holders"
        assert lock.exists()
        kill_process(lock_holder)
        kill_process(device_holder)
        lock.write_text("a real TPU job's lock\n")      # no live holder: looks stale
        assert devices() == (2, "cpu")
        assert lock.read_text() == "a real TPU job's lock\n", \
            "a simulated agent removed the real TPU's lock file"
    finally:
        kill_process(lock_holder)
        kill_process(device_holder)
        agents.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_that_does_not_simulate_still_guards_the_tpu(tpu_files):
    """The other side: without --simulate-devices (here 0) a foreign holder blocks."""
    lock, _ = tpu_files
    agents = _agent(tpu_files, 0)
    holder = hold_open(str(lock))
    try:
        @remote_tpu.run(accelerator="tpu-v4-8", hosts=agents.addresses[0],
                        token=agents.token)
        def nothing():
            return None

        with pytest.raises(remote_tpu.JobFailedError) as info:
            nothing()
        assert f"pid {holder.pid}" in str(info.value)
        assert "--kill-tpu-holders" in str(info.value)
        assert holder.poll() is None and lock.exists()
    finally:
        kill_process(holder)
        agents.stop()


@pytest.mark.slow
def test_a_lock_held_by_the_agents_own_worker_is_never_taken_for_stale(tpu_files):
    from remote_tpu._core.channels import Credentials, health

    lock, _ = tpu_files
    agents = _agent(tpu_files, 0)
    try:
        @remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                        token=agents.token)
        def use_the_tpu(path):
            import os
            import time
            held = open(path, "a")         # as libtpu holds its lock while it runs
            time.sleep(3)
            still = os.path.exists(path)
            held.close()
            return still

        result = []
        worker = threading.Thread(target=lambda: result.append(use_the_tpu(str(lock))))
        worker.start()
        credentials = Credentials(token=agents.token)
        while worker.is_alive():          # Health asks the guard whether the TPU is busy
            health(agents.addresses[0], credentials, attempts=1)
            time.sleep(0.1)
        worker.join()
        assert result == [True]
    finally:
        agents.stop()
