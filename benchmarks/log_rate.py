"""Log rate: a function that prints 1,000,000 short lines on a local tpu-v4-8
slice, against the same loop writing to a pipe read by ``cat`` (measured in the
same run), and the latency of a lone print.

    .venv/bin/python benchmarks/log_rate.py [--lines 1000000] [--prints 20]

Prints the time the loop takes inside the function and the baseline's (the
best of --repeats runs each), their ratio (issue 11: target <= 1.25x), whether every line reached the caller in
order, and the p50 of the time from a lone ``print`` in the function to the
moment the caller's terminal gets it (target <= 100 ms), unflushed (the
worker's flush timer delivers it) and flushed (only the way from the worker's
pipe through the agents to the caller).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import textwrap
import time

import remote_tpu

LOOP = textwrap.dedent("""
    import sys, time
    def loop(n):
        write = sys.stdout.write
        start = time.perf_counter()
        for i in range(n):
            write(f"line {i}\\n")
        return time.perf_counter() - start
""")


def baseline(lines: int) -> float:
    """The loop in a process whose stdout is a pipe that ``cat`` reads."""
    code = LOOP + f"took = loop({lines})\nsys.stdout.flush()\nprint(took, file=sys.stderr)\n"
    cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # as by default
    proc = subprocess.run([sys.executable, "-c", code], stdout=cat.stdin, env=env,
                          stderr=subprocess.PIPE, text=True, check=True)
    cat.stdin.close()
    cat.wait()
    return float(proc.stderr.strip().splitlines()[-1])


class _Lines(io.TextIOBase):
    """Where the caller's copy of the output goes: counted and checked, not shown."""

    def __init__(self) -> None:
        self.count = 0
        self.in_order = True
        self._partial = ""
        self.first_at = 0.0

    def write(self, text: str) -> int:
        self.first_at = self.first_at or time.perf_counter()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith("line "):
                if line != f"line {self.count}":
                    self.in_order = False
                self.count += 1
        return len(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--prints", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each loop; the best of each is compared")
    args = parser.parse_args()

    namespace: dict = {}
    exec(LOOP, namespace)
    loop = namespace["loop"]

    @remote_tpu.run(accelerator="tpu-v4-8", hosts="local", keep_warm=600)
    def many(n):
        return loop(n)

    @remote_tpu.run(accelerator="tpu-v4-8", hosts="local", keep_warm=600)
    def lone(pause, flush=False):
        time.sleep(pause)
        sent = time.time()
        print("ping", flush=flush)
        time.sleep(0.5)          # the call stays open: only a flush can deliver it
        return sent

    real_stdout = sys.stdout
    sys.stdout = _Lines()
    try:
        lone(0)                               # starts the slice and its warm worker
    finally:
        sys.stdout = real_stdout
    runs = []
    for _ in range(args.repeats):
        sink = _Lines()
        sys.stdout = sink
        try:
            start = time.perf_counter()
            inside = many(args.lines)
            runs.append((inside, time.perf_counter() - start, sink))
        finally:
            sys.stdout = real_stdout
    inside, whole, sink = min(runs, key=lambda run: run[0])
    floor = min(baseline(args.lines) for _ in range(args.repeats))
    print(f"{args.lines:,} lines: {inside:.2f} s inside the function ({whole:.2f} s the whole "
          f"call), baseline loop into a pipe read by cat {floor:.2f} s: "
          f"ratio {inside / floor:.2f}x (target <= 1.25x)")
    for _, _, received in runs:
        print(f"lines received: {received.count:,} of {args.lines:,}, "
              f"in order: {received.in_order}")

    for flush, what in ((False, "lone print to the caller"),
                        (True, "lone print(flush=True): the worker's pipe to the caller")):
        latencies = []
        for _ in range(args.prints):
            seen = _Lines()
            sys.stdout = seen
            try:
                sent = lone(0.05, flush)
            finally:
                sys.stdout = real_stdout
            # The caller's clock and the host's are this machine's: comparable.
            latencies.append(seen.first_at - (sent - time.time() + time.perf_counter()))
        print(f"{what}: p50 {statistics.median(latencies) * 1e3:.1f} ms, "
              f"max {max(latencies) * 1e3:.1f} ms over {args.prints} (target p50 <= 100 ms)")
    many.release()


if __name__ == "__main__":
    os.environ.setdefault("REMOTE_TPU_STREAM", "leader")
    main()
