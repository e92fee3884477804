"""The agent daemon on its own: its command line, explicit peers, refusals, shutdown."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

import remote_tpu
from conftest import live_workers, wait_until
from raw_calls import probe_spec, refusal
from remote_tpu._core.channels import Redirect

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def two_agents(slice_factory):
    """Agents of the test's own, for a test that stops or kills one (the
    others share the module's ``agents``)."""
    return slice_factory(2)


@pytest.mark.slow
def test_gateway_address_alone_reaches_its_configured_peers(agents):
    @remote_tpu.run(accelerator="tpu-v5litepod-8", hosts=agents.addresses[0],
                    token=agents.token)
    def f():
        # v5litepod-8 is one host; this call must be refused: 2 agents behind the gateway
        return 1

    with pytest.raises(remote_tpu.ConfigurationError) as info:
        f()
    assert "tpu-v5litepod-8 has 1 host(s), but the slice behind the agent" in str(info.value)
    assert "lists 2" in str(info.value)
    assert "--print-slice" in str(info.value)                 # what to do: not "list hosts"
    assert "give only the gateway's address" not in str(info.value)

    @remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                    token=agents.token)
    def g():
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils
        total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1]))
        return int(total.sum()), jax.process_count(), jax.local_device_count()

    assert g() == (3, 2, 2)


def test_any_host_can_answer_the_client_follows_to_worker_0(agents):
    err = refusal(agents.addresses[1], probe_spec(accelerator="tpu-v4-16", num_hosts=2),
                   agents.token)
    assert isinstance(err, Redirect) and err.address == agents.addresses[0]

    @remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[1],
                    token=agents.token)
    def where():
        import jax
        return jax.process_index(), jax.process_count()

    assert where() == (0, 2)
    handle = where.submit()
    assert handle.result() == (0, 2)
    assert repr(handle).endswith(f"at {agents.addresses[0]}>")


def test_bad_flags_and_busy_port_exit_with_a_message():
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--simulate-devices",
                           "-1"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--simulate-devices must be >= 0" in proc.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--port", str(port)],
                              capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr


@pytest.mark.slow
def test_stopping_the_gateway_agent_stops_every_worker(two_agents):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts=two_agents.addresses[0],
                    token=two_agents.token)
    def sleeper():
        time.sleep(120)

    import threading
    errors = []

    def call():
        try:
            sleeper()
        except remote_tpu.RemoteTPUError as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert wait_until(lambda: len(live_workers()) == 2, timeout=60)
    two_agents.procs[0].send_signal(signal.SIGTERM)
    t.join(30)
    assert not t.is_alive() and errors, "the caller was not told"
    assert isinstance(errors[0], remote_tpu.JobFailedError)
    assert f"the gateway agent at {two_agents.addresses[0]} is shutting down" in str(errors[0])
    assert wait_until(lambda: not live_workers(), timeout=10), "workers outlived the agent"


@pytest.mark.slow
def test_peer_agent_dying_mid_job_fails_fast_naming_it(two_agents):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts=two_agents.addresses[0],
                    token=two_agents.token)
    def waits():
        from jax.experimental import multihost_utils
        print("in the job", flush=True)
        multihost_utils.sync_global_devices("started")
        time.sleep(120)

    import threading
    errors = []
    t = threading.Thread(target=lambda: errors.append(_raised(waits)))
    t.start()
    assert wait_until(lambda: len(live_workers()) == 2, timeout=60)
    time.sleep(1.0)
    two_agents.procs[1].kill()
    t.join(30)
    assert not t.is_alive()
    err = errors[0]
    assert isinstance(err, remote_tpu.JobFailedError) and err.host == 1, err
    assert f"agent at {two_agents.addresses[1]} failed: UNAVAILABLE" in str(err)
    assert "host 0: cancelled" in str(err)
    assert wait_until(lambda: not live_workers(), timeout=10), "a worker outlived its agent"


def test_unreachable_peer_is_reported_lost(two_agents):
    two_agents.procs[1].kill()
    two_agents.procs[1].wait()

    @remote_tpu.run(accelerator="tpu-v4-16", hosts=two_agents.addresses[0],
                    token=two_agents.token)
    def f():
        return 1

    err = _raised(f)
    assert isinstance(err, remote_tpu.JobFailedError) and err.host == 1
    assert "host 1: lost" in str(err)


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


@pytest.mark.slow
def test_several_processes_per_host_across_agents(agents):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                    token=agents.token, processes_per_host=2)
    def spread(fail_on=-1):
        import os

        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils
        if jax.process_index() == fail_on:
            raise RuntimeError(f"process {fail_on} gives up")
        ids = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
        return sorted(int(i) for i in ids.ravel()), jax.device_count(), \
            os.environ["REMOTE_TPU_HOST_INDEX"]

    assert spread() == ([0, 1, 2, 3], 4, "0")
    with pytest.raises(RuntimeError, match="process 3 gives up") as info:
        spread(3)
    assert any("raised on process 3 of 4" in note for note in info.value.__notes__)
    assert wait_until(lambda: not live_workers(), 5)


def test_the_agent_refuses_a_max_log_bytes_too_small_for_a_record(tmp_path):
    """Each host's log is kept in parts of an eighth of --max-log-bytes, each
    holding at least one record (5 bytes of framing and its data)."""
    import subprocess
    import sys

    MIN_LOG_BYTES = 512
    def start(size: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--print-slice",
                               "--worker-id", "0", "--peers", "127.0.0.1:1",
                               "--max-log-bytes", size], capture_output=True, text=True,
                              timeout=60)
    refused = start(str(MIN_LOG_BYTES - 1))
    assert refused.returncode == 2
    assert f"--max-log-bytes must be at least {MIN_LOG_BYTES}" in refused.stderr
    assert f"got {MIN_LOG_BYTES - 1}" in refused.stderr
    assert start(str(MIN_LOG_BYTES)).returncode == 0
