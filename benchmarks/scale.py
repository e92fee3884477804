"""Scale: a trivial ``init_jax=False`` call on 4, 16 and 64 local hosts
(tpu-v4-32, tpu-v4-128, tpu-v4-512), agents already up, and each agent's
resident memory while idle.

    .venv/bin/python benchmarks/scale.py [--calls 5] [--sizes tpu-v4-32,tpu-v4-512]

For each slice: the median of --calls cold calls (a new worker on every host
each time: each once the machine is quiet, the spares that the call before used
replaced, as for a user who calls now and then; 64 simulated hosts' spares take
a few seconds of this machine's CPU to replace, where a real slice's hosts
replace theirs each on its own) and of ten times as many warm ones (keep_warm:
the workers stay), then the
ratio of the 64-host median to the 4-host one (issue 11: target <= 3x), and
the largest and median idle agent RSS (target <= 60 MB).

Also the CPU each call costs the gateway (host 0's agent) and the whole
machine. Here every host shares two cores, so a 64-host call takes about the
whole machine's CPU per call over two; on a real slice each host has its own,
and what grows with the host count is the gateway's share.

Then the floor, the same sizes timed the same way (``_process_floor.py``):
a relay process and a worker process per host passing 8 bytes on, nothing
else. Any design whose hosts are processes on this machine does at least
that much per host on the same two cores, so the floor's 64-host time bounds
our 64-host time from below, and with it the ratio to our 4-host call
(--no-floor skips it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil

import remote_tpu
from remote_tpu._core.topology import Topology
from remote_tpu._local_slice import get_local_slice, stop_local_slices
from _process_floor import floor
from _quiet import wait_quiet


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _timed(fn, calls: int, gateway: psutil.Process, quiet: bool = False
           ) -> tuple[float, float, float]:
    """The median call, and the mean CPU per call of the gateway (host 0's
    agent) and of the whole machine."""
    samples, gateway_cpu, machine_cpu = [], 0.0, 0.0
    for _ in range(calls):
        if quiet:
            wait_quiet()
        before, machine = _cpu_seconds(gateway), psutil.cpu_times()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        after = psutil.cpu_times()
        gateway_cpu += _cpu_seconds(gateway) - before
        machine_cpu += (after.user + after.system) - (machine.user + machine.system)
    return statistics.median(samples), gateway_cpu / calls, machine_cpu / calls


def _idle_rss_mb(accelerator: str) -> list[float]:
    agents = get_local_slice(Topology.parse(accelerator)).procs
    return sorted(psutil.Process(p.pid).memory_info().rss / 2**20 for p in agents)


def measure(accelerator: str, calls: int) -> tuple[float, float, list[float]]:
    hosts = Topology.parse(accelerator).hosts

    @remote_tpu.run(accelerator=accelerator, hosts="local", init_jax=False, stream="none")
    def cold():
        import os
        return int(os.environ["REMOTE_TPU_HOST_INDEX"])

    @remote_tpu.run(accelerator=accelerator, hosts="local", init_jax=False, stream="none",
                    keep_warm=600)
    def warm():
        return 0

    started = time.perf_counter()
    assert cold() == 0                       # starts the agents
    print(f"  {accelerator}: {hosts} agents up and a first call in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    wait_quiet()
    rss = _idle_rss_mb(accelerator)
    gateway = psutil.Process(get_local_slice(Topology.parse(accelerator)).procs[0].pid)
    cold_times = _timed(cold, calls, gateway, quiet=True)
    warm()                                   # (its workers stay; the spares go on
    wait_quiet()                             # being replaced meanwhile: not timed)
    warm_times = _timed(warm, calls * 10, gateway)   # (more: CPU is counted in 10 ms ticks)
    warm.release()
    stop_local_slices()
    return cold_times, warm_times, rss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--sizes", default="tpu-v4-32,tpu-v4-128,tpu-v4-512")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the floor (a relay and a worker process per host)")
    args = parser.parse_args()
    results = {}
    for accelerator in args.sizes.split(","):
        results[accelerator] = measure(accelerator, args.calls)
    print()
    for accelerator, (cold, warm, rss) in results.items():
        hosts = Topology.parse(accelerator).hosts
        print(f"{accelerator:12s} {hosts:3d} hosts: cold call {cold[0] * 1e3:7.0f} ms, warm call "
              f"{warm[0] * 1e3:6.1f} ms; idle agent RSS median {statistics.median(rss):.0f} MB, "
              f"max {max(rss):.0f} MB")
        print(f"{'':18s} CPU per call: gateway cold {cold[1] * 1e3:5.0f} ms, warm "
              f"{warm[1] * 1e3:5.1f} ms; whole machine cold {cold[2] * 1e3:5.0f} ms, warm "
              f"{warm[2] * 1e3:5.1f} ms")
    floors = {}
    if not args.no_floor:
        print("\nthe floor: a relay process and a worker process per host, nothing else "
              "(benchmarks/_process_floor.py)", flush=True)
        for accelerator in results:
            hosts = Topology.parse(accelerator).hosts
            cold, warm = floor(hosts, "cold", args.calls), floor(hosts, "warm", args.calls * 10)
            floors[accelerator] = (cold, warm)
            print(f"{accelerator:12s} {hosts:3d} hosts: cold {cold * 1e3:7.1f} ms, "
                  f"warm {warm * 1e3:6.2f} ms", flush=True)
    names = list(results)
    if len(names) > 1:
        small, large = results[names[0]], results[names[-1]]
        print(f"{names[-1]} / {names[0]}: cold {large[0][0] / small[0][0]:.2f}x, warm "
              f"{large[1][0] / small[1][0]:.2f}x (target <= 3x)")
        print(f"  the gateway's CPU per call (what a real slice, each host on its own CPUs, "
              f"pays in one process): cold {large[0][1] / small[0][1]:.1f}x, warm "
              f"{large[1][1] / small[1][1]:.1f}x")
        if floors:
            low, high = floors[names[0]], floors[names[-1]]
            added = Topology.parse(names[-1]).hosts - Topology.parse(names[0]).hosts
            print(f"  the floor: cold {high[0] / low[0]:.1f}x, warm {high[1] / low[1]:.1f}x")
            print(f"  each host past the first {Topology.parse(names[0]).hosts}, in ms: ours "
                  f"cold {(large[0][0] - small[0][0]) / added * 1e3:.2f}, warm "
                  f"{(large[1][0] - small[1][0]) / added * 1e3:.3f}; the floor's cold "
                  f"{(high[0] - low[0]) / added * 1e3:.2f}, warm "
                  f"{(high[1] - low[1]) / added * 1e3:.3f}; what 3x allows: cold "
                  f"{2 * small[0][0] / added * 1e3:.2f}, warm {2 * small[1][0] / added * 1e3:.3f}")


if __name__ == "__main__":
    main()
