"""Fail-fast: host 1 raises while host 0 waits in a collective. Measures the time
from the raise on host 1 to the exception in the caller, by which point every
host's worker has been stopped (the gateway confirms each exit before it reports).
Baseline in the same run: a successful call of the same shape.

``--keep-warm``: the calls run in warm workers (``keep_warm=``): host 1's
exception then ends the session only once host 0 has not come back to rest
within the gateway's window (it waits in the collective), and each failed call
is followed by a cold one.

    .venv/bin/python benchmarks/fail_fast.py [--repeats N] [--keep-warm]
"""

from __future__ import annotations

import argparse
import statistics
import time

import remote_tpu


def fails_on_host_1(fail: bool):
    import time as t

    import jax
    from jax.experimental import multihost_utils
    if fail and jax.process_index() == 1:
        raise ValueError(t.time())
    multihost_utils.sync_global_devices("host 0 waits for host 1")
    return t.time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep-warm", action="store_true",
                        help="in warm workers (keep_warm=60)")
    args = parser.parse_args()
    call = remote_tpu.run(accelerator="tpu-v4-16", hosts="local", stream="none",
                          keep_warm=60 if args.keep_warm else None)(fails_on_host_1)
    call(False)       # start the agents
    stop, ok = [], []
    for _ in range(args.repeats):
        returned_at = call(False)
        ok.append(time.time() - returned_at)
        try:
            call(True)
        except ValueError as exc:
            stop.append(time.time() - float(exc.args[0]))
    s, o = statistics.median(stop), statistics.median(ok)
    print(f"raise on host 1 -> exception in caller, all workers stopped: median {s:.3f} s "
          f"[{', '.join(f'{x:.2f}' for x in stop)}]")
    print(f"baseline, return on host 0 -> value in caller:            median {o:.3f} s")
    print(f"ratio: {s / o:.1f}x; JAX alone would wait for its heartbeat timeout (100 s default)")


if __name__ == "__main__":
    main()
