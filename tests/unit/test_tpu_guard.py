"""The TPU guard an agent picks (agent/host/tpu.py), on its own: a simulating
agent's touches nothing. Agents that guard the TPU end to end:
tests/slice/test_tpu_guard_sim.py and tests/slice/test_tpu_vm.py."""

from __future__ import annotations

from conftest import hold_open, kill_process
from remote_tpu_agent.host.tpu import NoTpu, TpuGuard


def test_for_agent_picks_a_guard_that_touches_nothing_when_simulating(tpu_files):
    lock, device = tpu_files
    simulated = TpuGuard.for_agent(2, str(lock), (str(device),), True)
    real = TpuGuard.for_agent(0, str(lock), (str(device),), False)
    assert isinstance(simulated, NoTpu) and type(real) is TpuGuard
    assert (real.lockfile, real.devices) == (str(lock), (str(device),))
    holder = hold_open(str(lock))
    try:
        assert simulated.busy() == ""
        simulated.prepare()                        # neither raises nor kills
        simulated.release()
        assert holder.poll() is None and lock.exists()
    finally:
        kill_process(holder)
    lock.write_text("left by a process that died\n")      # stale: nobody holds it
    simulated.prepare()
    simulated.release()
    assert lock.read_text() == "left by a process that died\n"
    real.release()
    assert not lock.exists(), "a real agent still removes a stale lock"
