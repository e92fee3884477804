"""Warm call: a trivial @remote_tpu.run(keep_warm=...) on a local tpu-v4-32 slice
(4 hosts) against Ray's fan-out of the same trivial call to as many long-lived
actors on this machine (4), measured in the same run.

    .venv/bin/python -m pip install -e ".[bench]"      # Ray, for the baseline
    .venv/bin/python benchmarks/warm_call.py [--calls 200] [--accelerator tpu-v4-8]

Prints p50 and p90 of each over --calls calls, and the ratio of the p50s
(issue 10: target <= 1.5x, goal <= 1.0x). Without Ray it prints ours alone and
says how to get the baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import remote_tpu
from _quiet import wait_quiet


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=10)
    return statistics.median(samples), q[8]


def time_calls(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def ours(calls: int, accelerator: str) -> tuple[list[float], float]:
    @remote_tpu.run(accelerator=accelerator, hosts="local", keep_warm=600, stream="none")
    def trivial():
        return 1

    start = time.perf_counter()
    assert trivial() == 1                    # cold: starts the slice and the workers
    cold = time.perf_counter() - start
    for _ in range(5):
        trivial()                            # settle
    wait_quiet()                             # the spares replaced since, not timed
    samples = time_calls(trivial, calls)
    trivial.release()
    return samples, cold


def ray_baseline(calls: int, actors: int) -> list[float] | None:
    try:
        import ray
    except ImportError:
        return None
    for tries_left in (1, 0):
        try:
            ray.init(num_cpus=actors, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            break
        except Exception as exc:  # noqa: BLE001 - Ray's own start-up, on a busy machine
            ray.shutdown()
            if not tries_left:
                print(f"Ray did not start here ({type(exc).__name__}: {exc}): "
                      "no baseline in this run; run the benchmark again")
                return None
    try:
        @ray.remote(num_cpus=1)
        class Host:
            def call(self):
                return 1

        hosts = [Host.remote() for _ in range(actors)]
        ray.get([a.call.remote() for a in hosts])

        def fan_out():
            assert ray.get([a.call.remote() for a in hosts]) == [1] * actors
        for _ in range(5):
            fan_out()
        return time_calls(fan_out, calls)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--accelerator", default="tpu-v4-32")
    args = parser.parse_args()
    hosts = remote_tpu.Topology.parse(args.accelerator).hosts
    samples, cold = ours(args.calls, args.accelerator)
    p50, p90 = percentiles(samples)
    print(f"remote_tpu warm call, {args.accelerator} ({hosts} hosts): p50 {p50 * 1e3:.1f} ms, "
          f"p90 {p90 * 1e3:.1f} ms over {args.calls} calls (first, cold call: {cold:.2f} s)")
    baseline = ray_baseline(args.calls, hosts)
    if baseline is None:
        if importlib.util.find_spec("ray") is not None:
            return
        print("Ray is not installed: `.venv/bin/python -m pip install -e '.[bench]'` "
              "for the baseline")
        return
    r50, r90 = percentiles(baseline)
    print(f"Ray fan-out to {hosts} actor(s):                 p50 {r50 * 1e3:.1f} ms, "
          f"p90 {r90 * 1e3:.1f} ms over {args.calls} calls")
    print(f"ratio of p50s: {p50 / r50:.2f}x (target <= 1.5x, goal <= 1.0x)")


if __name__ == "__main__":
    main()
