"""The stall report's grouping of stacks, and a job's live metrics, from
faulthandler texts and events made here (agent/gateway/stalls.py, metrics.py)."""

from __future__ import annotations

import threading
import time

from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.gateway.metrics import STALE, JobMetrics
from remote_tpu_agent.gateway.stalls import StallWatch, report


def _dump(*inner: str, importing: bool = False) -> str:
    """A worker's faulthandler dump: a background thread (listed first, as
    faulthandler does; one importing a module if ``importing``), then the
    main thread, started by runpy, running ``inner`` (innermost first)."""
    background = ['  File "/lib/threading.py", line 331 in wait']
    if importing:
        background.insert(0, '  File "/lib/some_module.py", line 3 in <module>')
    main = [f'  File "/job/train.py", line {n} in {fn}' for fn, n in inner] + [
        '  File "/agent/worker/child.py", line 400 in main',
        '  File "/agent/worker/child.py", line 440 in <module>',
        '  File "<frozen runpy>", line 88 in _run_code',
        '  File "<frozen runpy>", line 198 in _run_module_as_main']
    return "\n".join(["Thread 0x00007f01 (most recent call first):", *background, "",
                      "Current thread 0x00007f02 (most recent call first):", *main])


def test_the_host_apart_from_the_largest_group_is_named_with_its_frames():
    waiting = _dump(("all_gather", 50), ("step", 12), ("train", 3))
    stuck = _dump(("load_batch", 80), ("step", 9), ("train", 3), importing=True)
    stacks = [pb.HostStacks(host=h, text=stuck if h == 2 else waiting) for h in range(4)]
    stall = report("j-1", 301.2, stacks, cancel=False)
    assert list(stall.odd_hosts) == [2] and not stall.cancelled
    odd, usual = stall.text.split("where hosts 0, 1, 3 are at:")
    assert "host 2 differs from the other 3 (hosts 0, 1, 3); it is at:" in odd
    assert "line 80 in load_batch" in odd and "line 9 in step" in odd
    assert "line 3 in train" not in odd                  # the frames they share: not repeated
    assert "line 50 in all_gather" in usual and "line 12 in step" in usual
    assert "job j-1 stalled: no host made progress for 301 s" in stall.text


def test_a_tie_names_no_host_and_one_host_says_where_it_is():
    a, b = _dump(("f", 1)), _dump(("g", 2))
    tie = report("j", 10, [pb.HostStacks(host=0, text=a), pb.HostStacks(host=1, text=b)],
                 cancel=True)
    assert list(tie.odd_hosts) == [] and "none in a larger group" in tie.text
    assert "on_stall='cancel': the job is stopped." in tie.text
    one = report("j", 10, [pb.HostStacks(host=0, text=a)], cancel=False)
    assert "host 0 is at:" in one.text and list(one.odd_hosts) == []
    same = report("j", 10, [pb.HostStacks(host=h, text=a) for h in range(3)], cancel=False)
    assert "every host is at the same place (hosts 0, 1, 2)" in same.text
    gone = report("j", 10, [pb.HostStacks(host=0, text="(the worker is not running)"),
                            pb.HostStacks(host=1, text=a), pb.HostStacks(host=2, text=a)],
                  cancel=False)
    assert list(gone.odd_hosts) == [0] and "(the worker is not running)" in gone.text


def test_the_watch_waits_for_every_worker_and_only_busy_looks_move_it():
    watch = StallWatch(0.05, starting=2)
    time.sleep(0.1)
    assert watch.due() is None                          # a worker has yet to start
    watch.saw(pb.Event(host=0, started=pb.Started()))
    watch.saw(pb.Event(host=1, started=pb.Started()))
    watch.saw(pb.Event(host=1, progress=pb.Progress(cpu_seconds=3, busy=False)))
    time.sleep(0.1)
    quiet = watch.due()
    assert quiet is not None and quiet >= 0.05
    assert watch.due() is None                          # once per quiet spell
    since = watch.quiet_since
    watch.saw(pb.Event(host=0, progress=pb.Progress(has_step=True, step=4)))
    assert watch.moved_since(since)                     # a report taken meanwhile is stale


def test_metrics_rates_go_stale_and_snapshots_are_safe_beside_the_loop():
    metrics = JobMetrics(2)
    metrics.saw(pb.Event(host=0, started=pb.Started()))
    metrics.saw(pb.Event(host=0, progress=pb.Progress(has_step=True, step=10)))
    time.sleep(0.3)
    metrics.saw(pb.Event(host=0, progress=pb.Progress(has_step=True, step=16)))
    metrics.saw(pb.Event(host=0, progress=pb.Progress(has_step=True, step=99)))   # too soon
    m = metrics.snapshot()[0]
    assert m.state == "running" and m.step == 16 and 10 < m.steps_per_second < 25
    metrics._hosts[0].step_at -= STALE + 1             # (no step since)
    assert metrics.snapshot()[0].steps_per_second == 0.0
    errors, stop = [], threading.Event()

    def loop():
        while not stop.is_set():
            metrics.saw(pb.Event(host=1, output=pb.Output(data=b"x" * 10)))

    def reader():
        try:
            for _ in range(300):
                metrics.snapshot()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)
    threads = [threading.Thread(target=loop), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    threads[1].join(30)
    stop.set()
    threads[0].join(30)
    assert errors == []
    assert len(metrics._hosts[1].output) <= 12           # counted per second, bounded
