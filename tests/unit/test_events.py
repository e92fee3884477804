"""A job's event queue (agent/jobs/events.py): what wakes its reader."""

from __future__ import annotations

import threading
import time

import pytest

from remote_tpu_agent.jobs.events import EventQueue

pytestmark = pytest.mark.timeout(30)


def _reader(events: EventQueue, got: list) -> threading.Thread:
    def read():
        for _ in range(2):
            got.append(events.get())
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_quiet_item_waits_for_the_next_waking_one_and_keeps_its_place():
    events, got = EventQueue(), []
    reader = _reader(events, got)
    time.sleep(0.1)                      # the reader waits
    events.put("quiet", wake=False)
    time.sleep(0.3)
    assert got == []                     # not woken by it
    events.put("loud")
    reader.join(5)
    assert got == ["quiet", "loud"]


def test_a_quiet_item_is_there_for_a_reader_that_comes_later_or_times_out():
    events = EventQueue()
    events.put("quiet", wake=False)
    assert events.get(timeout=0) == "quiet"
    got: list = []
    reader = threading.Thread(target=lambda: got.append(events.get(timeout=0.3)), daemon=True)
    reader.start()
    time.sleep(0.1)
    events.put("late", wake=False)       # a reader whose wait ends finds it
    reader.join(5)
    assert got == ["late"]
