"""End to end on a local simulated slice: real agents on loopback, real
multi-process JAX on CPU with cross-process collectives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

import remote_tpu
from conftest import live_workers, wait_until
from remote_tpu._local_slice import get_local_slice
from remote_tpu._core.versions import PROTOCOL_VERSION

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

V4_16 = dict(accelerator="tpu-v4-16", hosts="local")     # 2 hosts x 4 devices


def _sum_over_hosts():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    # Each host contributes its own rows; the sum needs every host's data.
    local = np.full((jax.local_device_count(), 2), float(jax.process_index() + 1))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    total = jax.jit(jnp.sum)(arr)
    return {"sum": float(total), "devices": jax.device_count(),
            "processes": jax.process_count(), "index": jax.process_index(),
            "local_devices": jax.local_device_count()}


@pytest.mark.parametrize("accelerator, hosts, per_host", [
    ("tpu-v4-16", 2, 4),
    ("tpu-v5litepod-16", 4, 4),
])
def test_cross_host_collective_matches_topology(accelerator, hosts, per_host):
    result = remote_tpu.run(accelerator=accelerator, hosts="local")(_sum_over_hosts)()
    # rows: per_host devices x 2 columns on each host, valued host index + 1
    expected = sum((h + 1) * per_host * 2 for h in range(hosts))
    assert result == {"sum": expected, "devices": hosts * per_host, "processes": hosts,
                      "index": 0, "local_devices": per_host}


def test_only_process_zero_value_returns_and_output_precedes_it(capfd):
    @remote_tpu.run(**V4_16)
    def f():
        import jax
        i = jax.process_index()
        for k in range(3):
            print(f"line {k} from host {i}")
        sys.stdout.write("no newline yet")
        os.write(1, b"|raw fd write from host %d\n" % i)    # below Python, like C/XLA
        if i != 0:
            return object()     # never pickled: a lock would fail if it were
        return i

    assert f() == 0
    out, _ = capfd.readouterr()
    # Python's stdout is block-buffered (flushed every 50 ms): a write below
    # Python can show before Python lines printed earlier, never inside one.
    raw = "|raw fd write from host 0\n"
    assert out.count(raw) == 1, out
    assert out.replace(raw, "", 1) == ("line 0 from host 0\nline 1 from host 0\n"
                                       "line 2 from host 0\nno newline yet")


def test_stream_all_prefixes_hosts_and_none_hides_everything(capfd):
    def f():
        import jax
        print(f"hi {jax.process_index()}")
        print(f"err {jax.process_index()}", file=sys.stderr)

    remote_tpu.run(stream="all", **V4_16)(f)()
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[host 0] hi 0", "[host 1] hi 1"]
    assert sorted(err.splitlines()) == ["[host 0] err 0", "[host 1] err 1"]
    assert "Gloo" not in out
    remote_tpu.run(stream="none", **V4_16)(f)()
    assert capfd.readouterr() == ("", "")


def test_environment_of_the_worker():
    @remote_tpu.run(env={"MY_SETTING": "on"}, **V4_16)
    def f():
        keys = ("MY_SETTING", "REMOTE_TPU_JOB_ID", "REMOTE_TPU_HOST_INDEX",
                "JAX_PLATFORMS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES")
        return {k: os.environ.get(k) for k in keys} | {"pgid": os.getpgrp() == os.getpid()}

    env = f()
    assert env["MY_SETTING"] == "on" and env["REMOTE_TPU_HOST_INDEX"] == "0"
    assert env["REMOTE_TPU_JOB_ID"].startswith("f-")
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_NUM_PROCESSES"] == "2"
    assert env["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    assert env["pgid"], "the worker leads its own process group"


def test_user_code_calling_initialize_itself_keeps_working():
    @remote_tpu.run(**V4_16)
    def f():
        import jax
        jax.distributed.initialize()    # as existing scripts do
        return jax.process_count()

    assert f() == 2


def test_exception_is_reraised_as_its_own_type_with_remote_traceback():
    @remote_tpu.run(**V4_16)
    def f(n):
        import jax
        if jax.process_index() == 0:
            raise KeyError(f"no such column {n}")
        return 1

    with pytest.raises(KeyError) as info:
        f(7)
    exc = info.value
    assert exc.args == ("no such column 7",)
    assert isinstance(exc.__cause__, remote_tpu.RemoteTraceback)
    tb = str(exc.__cause__)
    assert "Traceback on host 0 of 2" in tb
    assert 'raise KeyError(f"no such column {n}")' in tb and __file__ in tb
    assert any("raised on host 0 of 2" in note for note in exc.__notes__)
    assert exc.remote_host == 0


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):      # pickling drops b: cannot be rebuilt
        super().__init__(a)
        self.b = b


def test_unbuildable_exception_becomes_remote_error():
    @remote_tpu.run(accelerator="tpu-v4-8", hosts="local")
    def f():
        raise NeedsTwoArgs("first", "second")

    with pytest.raises(remote_tpu.RemoteError) as info:
        f()
    err = info.value
    assert err.type_name.endswith("NeedsTwoArgs") and err.host == 0
    assert 'raise NeedsTwoArgs("first", "second")' in err.remote_traceback


def test_failure_on_host_1_while_host_0_waits_in_a_collective(no_leftover_workers):
    @remote_tpu.run(**V4_16)
    def f():
        import jax
        from jax.experimental import multihost_utils
        if jax.process_index() == 1:
            time.sleep(1.0)
            raise ValueError("bad shard on host 1")
        multihost_utils.sync_global_devices("host 0 waits here for host 1")
        return "unreachable"

    get_local_slice(remote_tpu.Topology.parse("tpu-v4-16"))     # agents already up
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad shard on host 1") as info:
        f()
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"fail-fast took {elapsed:.1f} s"
    notes = "\n".join(info.value.__notes__)
    assert "raised on host 1 of 2" in notes
    assert "host 0: cancelled" in notes and "host 1: failed" in notes


@pytest.mark.parametrize("how, detail", [
    ("exit", "exited with code 3 before the function returned"),
    ("kill", "killed by SIGKILL"),
])
def test_dead_worker_is_reported_with_its_exit_and_last_lines(how, detail,
                                                               no_leftover_workers):
    @remote_tpu.run(**V4_16)
    def f():
        import jax
        from jax.experimental import multihost_utils
        if jax.process_index() == 1:
            print("last words of host 1", flush=True)
            if how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        multihost_utils.sync_global_devices("wait")

    with pytest.raises(remote_tpu.JobFailedError) as info:
        f()
    err = info.value
    assert err.host == 1
    msg = str(err)
    assert "host 1 of 2 (tpu-v4-16, job f-" in msg and detail in msg
    assert "| last words of host 1" in msg
    assert "host 0: cancelled" in msg


def test_unpicklable_return_value_is_named():
    @remote_tpu.run(accelerator="tpu-v4-8", hosts="local")
    def f():
        return {"model": threading.Lock()}

    with pytest.raises(remote_tpu.SerializationError,
                       match=r"cannot send the return value -> key 'model'"):
        f()


def test_timeout_stops_every_host(no_leftover_workers):
    @remote_tpu.run(timeout=3, **V4_16)
    def f():
        time.sleep(60)

    start = time.monotonic()
    with pytest.raises(remote_tpu.JobTimeoutError, match="timed out after 3 s"):
        f()
    assert time.monotonic() - start < 10


def test_big_argument_round_trips_exactly():
    big = np.random.default_rng(1).integers(0, 2**31, size=16 * 1024 * 1024, dtype=np.int32)

    @remote_tpu.run(accelerator="tpu-v4-8", hosts="local")
    def echo(a):
        import jax
        return a, int(a[::4096].sum()), jax.process_count()

    back, checksum, count = echo(big)          # 64 MiB out and back
    assert back.dtype == big.dtype and np.array_equal(back, big)
    assert checksum == int(big[::4096].sum()) and count == 1


def test_exec_closure_and_local_module_run_remotely(tmp_path, monkeypatch):
    (tmp_path / "my_local_helpers.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_local_helpers

    try:
        offset = 100
        ns = {"remote_tpu": remote_tpu, "my_local_helpers": my_local_helpers,
              "offset": offset}
        exec(textwrap.dedent("""
            @remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
            def cell(x):
                return my_local_helpers.double(x) + offset
        """), ns)
        # The agents' workers do not have tmp_path on sys.path: by value or nothing.
        assert ns["cell"](21) == 142
    finally:
        sys.modules.pop("my_local_helpers", None)


def test_unpicklable_argument_fails_before_anything_is_sent():
    calls_before = len(live_workers())

    @remote_tpu.run(**V4_16)
    def f(opt):
        return 1

    class Opt:
        lock = None

        def __init__(self):
            self.lock = threading.Lock()

    with pytest.raises(remote_tpu.SerializationError, match="argument 'opt' -> attribute 'lock'"):
        f(Opt())
    assert len(live_workers()) == calls_before == 0


def test_agents_are_reused_across_calls():
    topo = remote_tpu.Topology.parse("tpu-v4-16")
    first = get_local_slice(topo)
    pids = [p.pid for p in first.procs]
    remote_tpu.run(**V4_16)(lambda: 1)()
    assert [p.pid for p in get_local_slice(topo).procs] == pids


def _lives(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_agents_of_remote_tpu_local_and_their_workers_hear_sigterm():
    """`remote-tpu local` waits for SIGINT/SIGTERM with both blocked: neither
    its agents nor the user's code under them may inherit that."""
    local = psutil.Popen([sys.executable, "-m", "remote_tpu", "local", "--accelerator",
                          "tpu-v4-8"], stdout=subprocess.PIPE, text=True)
    try:
        env = dict(line.strip().split("=", 1) for line in
                   (local.stdout.readline() for _ in range(3)) if line.startswith("REMOTE_"))

        @remote_tpu.run(accelerator="tpu-v4-8", hosts=env["REMOTE_TPU_HOSTS"],
                        token=env["REMOTE_TPU_TOKEN"], init_jax=False)
        def blocked():
            import signal
            return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))

        assert blocked() == []
        [agent] = local.children()
        family = [agent, *agent.children(recursive=True)]      # its spare worker too
        agent.send_signal(signal.SIGTERM)           # (`local` reaps it only as it stops)
        assert wait_until(lambda: not any(_lives(p) for p in family), timeout=15)
    finally:
        local.send_signal(signal.SIGINT)
        local.wait(15)


def test_killed_client_leaves_no_agent_or_worker(tmp_path):
    marker = tmp_path / "started"
    code = textwrap.dedent(f"""
        import pathlib, time, remote_tpu
        @remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
        def f():
            import jax
            pathlib.Path({str(marker)!r} + str(jax.process_index())).touch()
            time.sleep(120)
        f()
    """)
    proc = psutil.Popen([sys.executable, "-c", code])
    try:
        assert wait_until(lambda: all(os.path.exists(f"{marker}{i}") for i in (0, 1)), 60)
        family = [p.pid for p in proc.children(recursive=True)]
        assert len(family) >= 4      # 2 agents + 2 workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        gone = wait_until(lambda: not any(psutil.pid_exists(p) and
                                          psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                          for p in family), timeout=15)
        assert gone, "agents or workers outlived their SIGKILLed client"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_version_mismatch_is_reported_with_both_versions():
    import grpc

    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc
    from remote_tpu._core.channels import error_from_rpc

    local = get_local_slice(remote_tpu.Topology.parse("tpu-v4-8"))
    address = local.addresses[0]
    spec = pb.JobSpec(client_versions=pb.Versions(protocol=999, remote_tpu="9.9.9",
                                                  python="3.11.0", cloudpickle="3.1.2"),
                      job_id="old-client", accelerator="tpu-v4-8", role=pb.ROLE_GATEWAY)
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.AgentStub(ch).Run(iter([pb.RunRequest(spec=spec)]),
                                           metadata=local.credentials.metadata))
    err = error_from_rpc(info.value, address)
    assert isinstance(err, remote_tpu.VersionMismatchError)
    assert f"this client cannot work with the agent at {address}" in str(err)
    assert "protocol 999 (remote_tpu 9.9.9) on this client" in str(err)
    assert (f"protocol {PROTOCOL_VERSION} (remote_tpu {remote_tpu.__version__}) on the agent "
            f"at {address}") in str(err)


def test_several_processes_per_host(capfd):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts="local", processes_per_host=2,
                    stream="all")
    def layout():
        import jax
        from jax.experimental import multihost_utils
        ids = multihost_utils.process_allgather(np.array([jax.process_index()]))
        print("ok")
        return {"processes": jax.process_count(), "devices": jax.device_count(),
                "local": jax.local_device_count(), "gathered": sorted(ids.ravel().tolist()),
                "host": os.environ["REMOTE_TPU_HOST_INDEX"]}

    assert layout() == {"processes": 4, "devices": 8, "local": 2, "gathered": [0, 1, 2, 3],
                        "host": "0"}
    out, _ = capfd.readouterr()
    assert sorted(out.splitlines()) == [f"[process {i}] ok" for i in range(4)]
    with pytest.raises(remote_tpu.ConfigurationError, match="use one of 1, 2, 4"):
        remote_tpu.run(accelerator="tpu-v4-16", hosts="local", processes_per_host=3)


@pytest.mark.timeout(60)
def test_a_stopped_local_slice_leaves_no_files():
    """Its agents' logs, job records and kept results go with it (a 1 GiB
    result is 1 GiB on disk: a notebook day of them filled a disk)."""
    from remote_tpu._local_slice import LocalSlice

    s = LocalSlice(hosts=1, devices_per_host=1)
    s.start()
    try:
        assert os.path.isdir(s.log_dir)
    finally:
        s.stop()
    assert not os.path.exists(s.log_dir)


@pytest.mark.timeout(120)
def test_the_files_of_a_killed_clients_slice_are_removed_by_the_next():
    """A client killed outright runs no exit handler: its slice's files stay,
    until the next local slice on this machine finds its client gone."""
    import subprocess

    from remote_tpu._local_slice import LocalSlice

    code = textwrap.dedent("""
        import os, signal, sys
        from remote_tpu._local_slice import LocalSlice
        s = LocalSlice(hosts=1, devices_per_host=1)
        s.start()
        print(s.log_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90)
    left = proc.stdout.strip()
    assert proc.returncode == -signal.SIGKILL and os.path.isdir(left), proc.stderr
    s = LocalSlice(hosts=1, devices_per_host=1)
    try:
        assert not os.path.exists(left)
        assert os.path.isdir(s.log_dir)          # its own, with its client alive, stays
    finally:
        s.stop()
