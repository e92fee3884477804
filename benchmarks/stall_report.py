"""Stall report: on a local slice, the last host sleeps in its function while
every other waits for it in a collective. Measures the time from the moment the
last host went quiet to the stall report in the caller, less ``stall_after``
(what the watch itself adds: its look, every process's stacks, the way back),
on 4 and 16 hosts; and what the watch costs the agents while a job is quiet
(their CPU per second during a sleeping job, stall_after on against off, in the
same run).

    .venv/bin/python -m pip install -e ".[bench]"      # psutil
    .venv/bin/python benchmarks/stall_report.py [--hosts 4 16] [--stall-after 2]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

import remote_tpu

ACCELERATOR = {4: "tpu-v4-32", 16: "tpu-v4-128"}


def last_host_sleeps():
    import time

    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("started")
    quiet_from = time.time()
    print(quiet_from, flush=True)            # the last output: from here on, quiet
    if jax.process_index() == jax.process_count() - 1:
        time.sleep(600)
    multihost_utils.sync_global_devices("the others wait here")


class _Arrivals(io.TextIOBase):
    """The caller's stderr: when the stall report came."""

    def __init__(self) -> None:
        self.report_at = 0.0

    def write(self, text: str) -> int:
        if "stalled: no host made progress" in text and not self.report_at:
            self.report_at = time.time()
        return len(text)


def _agents_cpu() -> float:
    """CPU seconds used so far by this process's agents (the local slice's)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if "remote_tpu_agent" in cmd and "remote_tpu_agent.worker" not in cmd:
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def time_to_report(hosts: int, stall_after: float) -> float:
    fn = remote_tpu.run(accelerator=ACCELERATOR[hosts], hosts="local", stream="all",
                        stall_after=stall_after, on_stall="cancel")(last_host_sleeps)
    seen, real = _Arrivals(), sys.stderr
    quiet_from = []

    class _Out(io.TextIOBase):
        def write(self, text: str) -> int:
            for line in text.splitlines():
                try:
                    quiet_from.append(float(line.split("] ", 1)[-1]))
                except ValueError:
                    pass
            return len(text)
    real_out, sys.stdout, sys.stderr = sys.stdout, _Out(), seen
    try:
        fn()
    except remote_tpu.JobFailedError:
        pass
    finally:
        sys.stdout, sys.stderr = real_out, real
    return seen.report_at - max(quiet_from) - stall_after


def quiet_cost(seconds: float) -> tuple[float, float]:
    """The agents' CPU per second during a job that sleeps on every host,
    stall_after on (the default, 300 s: no report comes) and off."""
    out = []
    for after in (300.0, False):
        def sleeps(s=seconds):
            import time
            time.sleep(s)
        fn = remote_tpu.run(accelerator="tpu-v4-32", hosts="local", stall_after=after,
                            on_stall="report", stream="none")(sleeps)
        before, start = _agents_cpu(), time.monotonic()
        try:
            fn()
        except remote_tpu.JobFailedError:
            pass
        out.append((_agents_cpu() - before) / (time.monotonic() - start))
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 16],
                        choices=sorted(ACCELERATOR))
    parser.add_argument("--stall-after", type=float, default=2.0)
    parser.add_argument("--quiet-seconds", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("REMOTE_TPU_STREAM", "all")
    for hosts in args.hosts:
        extra = time_to_report(hosts, args.stall_after)
        print(f"{hosts} hosts: the report came {extra:.2f} s after stall_after "
              f"({args.stall_after:g} s) of quiet")
    on, off = quiet_cost(args.quiet_seconds)
    print(f"4 hosts, a job asleep {args.quiet_seconds:g} s: the agents' CPU "
          f"{on * 1e3:.1f} ms/s with the watch (stall_after=300), {off * 1e3:.1f} ms/s "
          "without")


if __name__ == "__main__":
    main()
