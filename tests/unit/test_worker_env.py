"""The worker's environment: what of the agent's environment it sees, JAX's
variables, and the TPU variables that split a slice's chips between several
processes per host (on one host and across hosts)."""

from __future__ import annotations

import math

import pytest

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.topology import Topology
from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.worker.spares import fits
from remote_tpu_agent.worker.environment import (TPU_PROCESS_BASE_PORT, child_environment,
                                          num_processes, processes_per_host,
                                          slice_host_addresses, slice_host_bounds,
                                          tpu_process_env, worker_env)

pytestmark = pytest.mark.timeout(60)

TPU_NAMES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS",
             "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "ALLOW_MULTIPLE_LIBTPU_LOAD")


def _spec(accelerator: str, per_host: int, ips: list[str], **kw) -> pb.JobSpec:
    return pb.JobSpec(job_id="job-1", accelerator=accelerator, num_hosts=len(ips),
                      processes_per_host=per_host, payload_digest=bytes(16),
                      hosts=[f"{ip}:8475" for ip in ips], **kw)


def _tpu(env: dict[str, str]) -> dict[str, str]:
    return {k: env[k] for k in TPU_NAMES if k in env}


def _env(spec: pb.JobSpec, process_id: int, **kw) -> dict[str, str]:
    coordinator = kw.pop("coordinator", None) or f"{spec.hosts[0].rsplit(':', 1)[0]}:4321"
    return worker_env({"PATH": "/usr/bin"}, spec=spec, process_id=process_id,
                      coordinator=coordinator, simulate_devices=kw.pop("simulate", 0), **kw)


# ------------------------------------------------------------ across hosts


def test_v4_16_with_two_processes_per_host_spans_both_hosts():
    # v4-16: 8 chips as 2x2x2 over 2 hosts of 2x2x1 (https://cloud.google.com/tpu/docs/v4,
    # https://cloud.google.com/tpu/docs/v5p lists the same shapes): host grid 1x1x2.
    ips = ["10.0.0.2", "10.0.0.3"]
    spec = _spec("tpu-v4-16", 2, ips)
    addresses = "10.0.0.2:8476,10.0.0.2:8477,10.0.0.3:8476,10.0.0.3:8477"
    expected = [
        {"TPU_VISIBLE_CHIPS": "0,1", "TPU_PROCESS_PORT": "8476", "CLOUD_TPU_TASK_ID": "0"},
        {"TPU_VISIBLE_CHIPS": "2,3", "TPU_PROCESS_PORT": "8477", "CLOUD_TPU_TASK_ID": "1"},
        {"TPU_VISIBLE_CHIPS": "0,1", "TPU_PROCESS_PORT": "8476", "CLOUD_TPU_TASK_ID": "2"},
        {"TPU_VISIBLE_CHIPS": "2,3", "TPU_PROCESS_PORT": "8477", "CLOUD_TPU_TASK_ID": "3"},
    ]
    for process_id in range(4):
        env = _env(spec, process_id, host_addresses=ips)
        assert _tpu(env) == {
            **expected[process_id],
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1",   # the same split as on one host
            "TPU_PROCESS_BOUNDS": "2,1,2",             # (1,1,2) hosts x (2,1,1) per host
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TPU_PROCESS_ADDRESSES": addresses,
        }, process_id
        assert env["JAX_PROCESS_ID"] == str(process_id) and env["JAX_NUM_PROCESSES"] == "4"
        assert env["REMOTE_TPU_HOST_INDEX"] == str(process_id // 2)
        assert "JAX_PLATFORMS" not in env


def test_v5litepod_16_with_four_processes_per_host():
    # v5litepod-16: 4x4 chips over 4 hosts of 2x2 (https://cloud.google.com/tpu/docs/v5e):
    # host grid 2x2, one chip per process, 16 processes.
    ips = [f"10.1.0.{i}" for i in range(4)]
    spec = _spec("tpu-v5litepod-16", 4, ips)
    every = [f"{ip}:{TPU_PROCESS_BASE_PORT + k}" for ip in ips for k in range(4)]
    for process_id in range(16):
        host, k = divmod(process_id, 4)
        env = _env(spec, process_id, host_addresses=ips)
        assert _tpu(env) == {
            "TPU_VISIBLE_CHIPS": str(k),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "4,4,1",
            "TPU_PROCESS_ADDRESSES": ",".join(every),
            "TPU_PROCESS_PORT": str(8476 + k),
            "CLOUD_TPU_TASK_ID": str(process_id),
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        }
        assert every[process_id] == f"{ips[host]}:{env['TPU_PROCESS_PORT']}"
        assert env["JAX_NUM_PROCESSES"] == "16"


def test_addresses_come_from_the_spec_with_worker_0_as_the_coordinators_host():
    # The gateway's spec lists the agents; its own entry may be the client's view of
    # it (a tunnel): the coordinator's host is what its peers really reach.
    spec = _spec("tpu-v4-16", 2, ["127.0.0.1", "10.0.0.3"])
    assert slice_host_addresses(spec, "10.0.0.2:4321") == ["10.0.0.2", "10.0.0.3"]
    env = _env(spec, 3, coordinator="10.0.0.2:4321")
    assert env["TPU_PROCESS_ADDRESSES"] == \
        "10.0.0.2:8476,10.0.0.2:8477,10.0.0.3:8476,10.0.0.3:8477"
    assert env["CLOUD_TPU_TASK_ID"] == "3"


def test_a_peer_without_the_slices_hosts_is_told_why():
    spec = _spec("tpu-v4-16", 2, ["10.0.0.2", "10.0.0.3"])
    del spec.hosts[:]                      # what a peer receives if the gateway drops them
    with pytest.raises(ValueError, match="the gateway must send the slice's hosts"):
        _env(spec, 2, coordinator="10.0.0.2:4321")


def test_ipv6_hosts_are_bracketed():
    spec = _spec("tpu-v4-16", 2, ["fd00::2", "fd00::3"])
    env = _env(spec, 0, host_addresses=["fd00::2", "fd00::3"])
    assert env["TPU_PROCESS_ADDRESSES"] == \
        "[fd00::2]:8476,[fd00::2]:8477,[fd00::3]:8476,[fd00::3]:8477"


def test_a_slices_own_host_bounds_win_over_the_default_shape():
    # v4-64 is 2x4x4 chips by default (host grid 1x2x4); created --topology 2x2x8 its
    # metadata says TPU_HOST_BOUNDS=1,1,8. A value that does not fit the slice is ignored.
    ips = [f"10.0.0.{i}" for i in range(8)]
    spec = _spec("tpu-v4-64", 2, ips)

    def bounds(base):
        return worker_env(base, spec=spec, process_id=0, coordinator="10.0.0.0:1",
                          simulate_devices=0, host_addresses=ips)["TPU_PROCESS_BOUNDS"]
    assert bounds({}) == "2,2,4"
    assert bounds({"TPU_HOST_BOUNDS": "1,1,8"}) == "2,1,8"
    assert bounds({"TPU_HOST_BOUNDS": "2,2,8"}) == "2,2,4"
    assert bounds({"TPU_HOST_BOUNDS": "junk"}) == "2,2,4"


@pytest.mark.parametrize("accelerator, bounds", [
    # https://cloud.google.com/tpu/docs/v5p (same shapes for v4,
    # https://cloud.google.com/tpu/docs/v4): 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, 4x8x8,
    # 8x8x8, 8x8x16, 8x16x16, 16x16x16, 16x16x24 chips; hosts are 2x2x1 chips. The
    # v4-256 metadata seen on a real slice: TOPOLOGY 4x4x8, HOST_BOUNDS 2,2,8.
    ("v4-16", (1, 1, 2)), ("v4-32", (1, 1, 4)), ("v4-64", (1, 2, 4)),
    ("v4-128", (2, 2, 4)), ("v4-256", (2, 2, 8)), ("v4-512", (2, 4, 8)),
    ("v4-1024", (4, 4, 8)), ("v4-2048", (4, 4, 16)), ("v4-4096", (4, 8, 16)),
    ("v5p-8192", (8, 8, 16)), ("v5p-12288", (8, 8, 24)),
    # https://cloud.google.com/tpu/docs/v5e (v6e: https://cloud.google.com/tpu/docs/v6e):
    # 4x4, 4x8, 8x8, 8x16, 16x16 chips; multi-host VMs have 2x2 chips.
    ("v5litepod-16", (2, 2, 1)), ("v5litepod-32", (2, 4, 1)), ("v5litepod-64", (4, 4, 1)),
    ("v5litepod-128", (4, 8, 1)), ("v6e-256", (8, 8, 1)),
    # v2/v3 host bounds as torch_xla's _ACCELERATOR_TYPE_TO_HOST_BOUNDS
    # (torch_xla/_internal/tpu.py) lists them.
    ("v2-32", (2, 2, 1)), ("v2-128", (4, 4, 1)), ("v2-256", (4, 8, 1)),
    ("v2-512", (8, 8, 1)), ("v3-64", (2, 4, 1)), ("v3-1024", (8, 16, 1)),
    ("v3-2048", (16, 16, 1)),
    # One host.
    ("v4-8", (1, 1, 1)), ("v5litepod-8", (1, 1, 1)), ("v6e-4", (1, 1, 1)),
])
def test_slice_host_bounds_follow_cloud_tpus_documented_topologies(accelerator, bounds):
    assert slice_host_bounds(accelerator) == bounds


def test_every_valid_slice_gets_a_consistent_layout():
    """For every accelerator size and processes per host: the bounds count every
    process, the address list has one entry per process, and each process finds
    itself in it at its task id."""
    sizes = {"v4": range(8, 8193, 8), "v5p": range(8, 12289, 8),
             "v5litepod": (16, 32, 64, 128, 256), "v6e": (16, 32, 64, 128, 256),
             "v2": (32, 128, 256, 512), "v3": (32, 64, 128, 256, 512, 1024, 2048)}
    for generation, valid in sizes.items():
        for size in valid:
            topology = Topology.parse(f"tpu-{generation}-{size}")
            if topology.hosts == 1:
                continue
            assert math.prod(slice_host_bounds(topology)) == topology.hosts, topology.name
            if size not in (16, 64, 256, 4096, 12288):
                continue
            ips = [f"h{i}" for i in range(topology.hosts)]
            for n in (2, 4):
                for process_id in (0, n + 1, topology.hosts * n - 1):
                    env = tpu_process_env(topology.chips_per_host, n, process_id % n,
                                          host=process_id // n, host_addresses=ips,
                                          host_bounds=slice_host_bounds(topology))
                    procs = math.prod(int(d) for d in env["TPU_PROCESS_BOUNDS"].split(","))
                    chips = math.prod(int(d) for d in
                                      env["TPU_CHIPS_PER_PROCESS_BOUNDS"].split(","))
                    listed = env["TPU_PROCESS_ADDRESSES"].split(",")
                    assert procs == len(listed) == topology.hosts * n, topology.name
                    assert chips * n == topology.chips_per_host
                    assert len(env["TPU_VISIBLE_CHIPS"].split(",")) == chips
                    me = listed[int(env["CLOUD_TPU_TASK_ID"])]
                    assert me == f"h{process_id // n}:{env['TPU_PROCESS_PORT']}"


# ------------------------------------------------------------ one host: unchanged


def test_one_host_variables_follow_jax_documentation():
    # JAX's example: one host of 4 chips, one process per chip.
    assert tpu_process_env(4, 4, 2) == {
        "TPU_VISIBLE_CHIPS": "2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479",
        "TPU_PROCESS_PORT": "8478", "CLOUD_TPU_TASK_ID": "2",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    # Two processes of two chips, as JAX's own harness splits a 2x2 host.
    two = tpu_process_env(4, 2, 1)
    assert two["TPU_VISIBLE_CHIPS"] == "2,3" and two["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    assert two["TPU_PROCESS_BOUNDS"] == "2,1,1"
    eight = tpu_process_env(8, 8, 7)
    assert eight["TPU_PROCESS_BOUNDS"] == "2,4,1" and eight["TPU_VISIBLE_CHIPS"] == "7"


@pytest.mark.parametrize("accelerator, n", [("tpu-v4-8", 2), ("tpu-v4-8", 4),
                                            ("tpu-v5litepod-8", 8)])
def test_one_host_slices_keep_localhost_addresses(accelerator, n):
    chips = Topology.parse(accelerator).chips_per_host
    spec = _spec(accelerator, n, ["10.0.0.2"])
    for k in range(n):
        env = _env(spec, k)
        assert _tpu(env) == tpu_process_env(chips, n, k)
        assert env["TPU_PROCESS_ADDRESSES"] == ",".join(
            f"localhost:{8476 + j}" for j in range(n))
        assert env["CLOUD_TPU_TASK_ID"] == str(k)


def test_one_process_per_host_and_simulated_devices_set_no_tpu_variables():
    multi = _spec("tpu-v4-16", 1, ["10.0.0.2", "10.0.0.3"])
    assert _tpu(_env(multi, 1)) == {}              # libtpu reads the TPU metadata itself
    simulated = _spec("tpu-v4-16", 2, ["127.0.0.1", "127.0.0.1"])
    del simulated.hosts[:]                         # a simulated peer needs no addresses
    env = _env(simulated, 3, coordinator="127.0.0.1:5", simulate=4)
    assert _tpu(env) == {}
    assert env["JAX_PLATFORMS"] == "cpu" and env[_worker.ENV_SIMULATE_DEVICES] == "2"


def test_jax_and_job_variables():
    spec = _spec("tpu-v4-16", 1, ["10.0.0.2", "10.0.0.3"], env={"MY_FLAG": "1"},
                 jax_timeouts=pb.JaxTimeouts(initialization_seconds=30,
                                             heartbeat_seconds=7, shutdown_seconds=3))
    env = worker_env({"PATH": "/bin", "MY_FLAG": "0"}, spec=spec, process_id=1,
                     coordinator="10.0.0.2:4321", simulate_devices=0)
    assert env["PATH"] == "/bin" and env["MY_FLAG"] == "1"      # the user's env= wins
    assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.2:4321"
    assert (env["JAX_PROCESS_ID"], env["JAX_NUM_PROCESSES"]) == ("1", "2")
    assert env["REMOTE_TPU_NUM_HOSTS"] == "2" and env["REMOTE_TPU_JOB_ID"] == "job-1"
    assert env[_worker.ENV_INIT_TIMEOUT] == "30" and env[_worker.ENV_HEARTBEAT_TIMEOUT] == "7"
    assert env[_worker.ENV_SHUTDOWN_TIMEOUT] == "3"
    assert processes_per_host(pb.JobSpec()) == 1
    assert num_processes(_spec("tpu-v4-16", 2, ["a", "b"])) == 4


# ------------------------------------------------------------ what passes


def test_child_environment_keeps_runtime_and_accelerator_variables_only():
    agent = {
        "PATH": "/usr/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "LD_LIBRARY_PATH": "/l",
        "TPU_NAME": "t1", "JAX_TRACEBACK_FILTERING": "off", "XLA_FLAGS": "--x",
        "LIBTPU_INIT_ARGS": "--y", "CLOUD_TPU_TASK_ID": "0", "OMP_NUM_THREADS": "4",
        "REMOTE_TPU_TOKEN": "secret", "REMOTE_TPU_HOSTS": "a,b",
        "AWS_SECRET_ACCESS_KEY": "s", "GOOGLE_APPLICATION_CREDENTIALS": "/key.json",
        "WANDB_API_KEY": "w", "PYTHONPATH": "/p", "STORAGE_EMULATOR_HOST": "http://gcs",
    }
    assert child_environment(agent) == {
        "PATH": "/usr/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "LD_LIBRARY_PATH": "/l",
        "TPU_NAME": "t1", "JAX_TRACEBACK_FILTERING": "off", "XLA_FLAGS": "--x",
        "LIBTPU_INIT_ARGS": "--y", "CLOUD_TPU_TASK_ID": "0", "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/p", "STORAGE_EMULATOR_HOST": "http://gcs"}
    more = child_environment(agent, frozenset({"WANDB_API_KEY", "REMOTE_TPU_TOKEN"}))
    assert more["WANDB_API_KEY"] == "w"
    assert "REMOTE_TPU_TOKEN" not in more            # never, even when asked for
    assert "AWS_SECRET_ACCESS_KEY" not in more
    pip = {"PIP_INDEX_URL": "https://mirror/simple", "https_proxy": "http://proxy:3128"}
    assert child_environment({**agent, **pip}, installer=True).items() >= pip.items()
    assert not child_environment({**agent, **pip}).keys() & pip.keys()   # a worker's


def test_only_variables_read_after_start_up_may_differ_from_the_spares():
    spare = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    job = {**spare, "JAX_COORDINATOR_ADDRESS": "10.0.0.2:1", "JAX_PROCESS_ID": "3",
           "JAX_NUM_PROCESSES": "4", "TPU_VISIBLE_CHIPS": "0", "MY_FLAG": "1"}
    assert not fits(spare, job)                   # a user's env= may be read at start-up
    job.pop("MY_FLAG")
    assert fits(spare, job)                       # per-job variables are read later
    assert fits(spare, {**job, "REMOTE_TPU_JOB_ID": "j-1", "MEGASCALE_NUM_SLICES": "2"})
    assert not fits(spare, {**job, "OPENBLAS_NUM_THREADS": "1"})
    assert not fits(spare, {**job, "XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert not fits(spare, {**job, "JAX_ENABLE_X64": "1"})
    assert not fits(spare, {**job, "PYTHONPATH": "/opt/mine"})
    assert not fits(spare, {k: v for k, v in job.items() if k != "JAX_PLATFORMS"})
