"""The agent's durable job store and its per-host logs, directly: records,
re-opening, log offsets and their bounds, pruning, permissions. Fast, no agents,
no JAX."""

from __future__ import annotations

import os
import time

import pytest

from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.limits import DETAIL_CHARS
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.jobs import host_log
from remote_tpu_agent.jobs.host_log import HostLog
from remote_tpu_agent.jobs.store import JobStore

from conftest import mode, umask

pytestmark = pytest.mark.timeout(60)

OUT = pb.OUTPUT_STREAM_STDOUT
ERR = pb.OUTPUT_STREAM_STDERR
FRAME = 5                    # a log record's header: stream (1 byte), length (4 bytes)


@pytest.fixture(autouse=True)
def no_time_marks(request, monkeypatch):
    """Logs without time marks (host_log.TIME_MARK), so that the framing tests
    can count bytes; the tests of the marks turn them on themselves."""
    if "marks" not in request.node.name:
        monkeypatch.setattr(host_log, "MARK_SECONDS", float("inf"))


@pytest.fixture
def state(tmp_path):
    return str(tmp_path / "state")


@pytest.fixture
def store(state):
    s = JobStore(state)
    yield s
    s.close()


def spec(job_id: str) -> pb.JobSpec:
    return pb.JobSpec(job_id=job_id, accelerator="tpu-v5litepod-8", num_hosts=2)


def finish(store: JobStore, job_id: str, payload: bytes = b"") -> None:
    """A job that ran and succeeded, with ``payload`` as host 0's output."""
    record, created = store.create(spec(job_id), pb.ROLE_GATEWAY)
    assert created
    if payload:
        record.append_output(0, OUT, payload)
    record.set_phase(pb.JOB_PHASE_SUCCEEDED, end=pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED))
    time.sleep(0.002)                   # created_at orders them


def listed(store: JobStore, role: int = pb.ROLE_GATEWAY) -> list[str]:
    return [s.job_id for s in store.list(role)]


def job_dirs(state: str) -> list[str]:
    return sorted(os.listdir(os.path.join(state, "jobs")))


# ---------------------------------------------------------------- records

def test_a_new_record_is_queued_with_its_spec(store):
    record, created = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    assert created is True
    assert record.job_id == "job-a"
    assert record.status.phase == pb.JOB_PHASE_QUEUED
    assert record.status.accelerator == "tpu-v5litepod-8"
    assert record.status.num_hosts == 2
    assert record.status.created_at > 0
    assert record.finished is False
    assert not os.path.exists(record.dir)          # made when something goes there
    record.append_output(0, OUT, b"x")
    assert os.path.isdir(record.dir)


def test_create_twice_returns_the_existing_record_not_a_new_one(store):
    first, created = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    first.set_phase(pb.JOB_PHASE_RUNNING)
    second, created_again = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    assert created is True and created_again is False
    assert second is first
    assert second.status.phase == pb.JOB_PHASE_RUNNING
    assert listed(store) == ["job-a"]


def test_an_id_is_known_again_after_a_restart_and_as_its_job_ends(state):
    """A new id costs no query (create looks in memory), so memory must know
    every job the table holds: those of an earlier run, and one ending now."""
    store = JobStore(state)
    finish(store, "job-a")
    store.create(spec("job-b"), pb.ROLE_GATEWAY)              # left running
    again = JobStore(state)                                    # restarted
    for job_id, phase in (("job-a", pb.JOB_PHASE_SUCCEEDED), ("job-b", pb.JOB_PHASE_LOST)):
        record, created = again.create(spec(job_id), pb.ROLE_GATEWAY)
        assert created is False and record.status.phase == phase
    record, _ = again.create(spec("job-c"), pb.ROLE_GATEWAY)
    record.set_phase(pb.JOB_PHASE_SUCCEEDED)
    assert again.create(spec("job-c"), pb.ROLE_GATEWAY)[1] is False
    assert again.create(spec("job-c"), pb.ROLE_PEER)[1] is True     # (each role its own)


def test_create_of_a_finished_job_again_returns_it_finished(store):
    finish(store, "job-a")
    again, created = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    assert created is False
    assert again.status.phase == pb.JOB_PHASE_SUCCEEDED


def test_gateway_and_peer_records_of_one_id_are_separate(store):
    gateway, g_created = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    peer, p_created = store.create(spec("job-a"), pb.ROLE_PEER)
    assert g_created and p_created
    assert gateway is not peer
    assert gateway.dir != peer.dir
    assert os.path.basename(gateway.dir) == "job-a.gateway"
    assert os.path.basename(peer.dir) == "job-a.peer"
    peer.set_phase(pb.JOB_PHASE_FAILED, "peer failed")
    assert store.get("job-a", pb.ROLE_GATEWAY).status.phase == pb.JOB_PHASE_QUEUED
    assert store.get("job-a", pb.ROLE_PEER).status.phase == pb.JOB_PHASE_FAILED
    assert listed(store, pb.ROLE_GATEWAY) == ["job-a"]
    assert listed(store, pb.ROLE_PEER) == ["job-a"]


def test_get_of_an_unknown_job_is_none(store):
    store.create(spec("job-a"), pb.ROLE_GATEWAY)
    assert store.get("job-b") is None
    assert store.get("job-a", pb.ROLE_PEER) is None


def test_list_is_newest_first_and_honours_its_limit(store):
    for name in ("job-1", "job-2", "job-3"):
        store.create(spec(name), pb.ROLE_GATEWAY)
        time.sleep(0.002)
    assert listed(store) == ["job-3", "job-2", "job-1"]
    assert [s.job_id for s in store.list(limit=2)] == ["job-3", "job-2"]


def test_a_finished_state_survives_reopening_the_store(state):
    store = JobStore(state)
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    record.set_phase(pb.JOB_PHASE_RUNNING)
    started = record.status.started_at
    record.set_phase(pb.JOB_PHASE_FAILED, "host 1 failed: ValueError: boom",
                     pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=1, detail="boom"))
    store.close()

    again = JobStore(state)
    try:
        status = again.get("job-a").status
        assert status.phase == pb.JOB_PHASE_FAILED
        assert status.detail == "host 1 failed: ValueError: boom"
        assert status.started_at == started > 0
        assert status.ended_at >= started
        assert status.end.state == pb.JOB_STATE_FAILED
        assert status.end.root_cause_host == 1
        assert status.end.detail == "boom"
        assert again.get("job-a").spec.accelerator == "tpu-v5litepod-8"
    finally:
        again.close()


def test_reopening_marks_queued_and_running_jobs_lost_and_keeps_their_logs(state):
    store = JobStore(state)
    running, _ = store.create(spec("job-run"), pb.ROLE_GATEWAY)
    running.set_phase(pb.JOB_PHASE_RUNNING)
    running.append_output(0, OUT, b"half way\n")
    store.create(spec("job-wait"), pb.ROLE_GATEWAY)
    store.create(spec("job-peer"), pb.ROLE_PEER)[0].set_phase(pb.JOB_PHASE_RUNNING)
    finish(store, "job-done")
    store.close()                                   # the agent died here

    again = JobStore(state)
    try:
        run = again.get("job-run").status
        assert run.phase == pb.JOB_PHASE_LOST
        assert run.detail == ("its agent stopped or restarted while the job was running; "
                              "the logs up to then are kept")
        assert run.end.state == pb.JOB_STATE_LOST
        assert run.end.root_cause_host == -1
        assert run.end.detail == run.detail
        assert run.ended_at > 0
        wait = again.get("job-wait").status
        assert wait.phase == pb.JOB_PHASE_LOST
        assert "while the job was queued" in wait.detail
        assert again.get("job-peer", pb.ROLE_PEER).status.phase == pb.JOB_PHASE_LOST
        assert again.get("job-done").status.phase == pb.JOB_PHASE_SUCCEEDED
        assert [(s, d) for s, d, _ in again.get("job-run").log(0).read(0)] == \
            [(OUT, b"half way\n")]
    finally:
        again.close()


def test_a_long_detail_is_cut_and_one_at_the_limit_is_not(store):
    at_limit, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    at_limit.set_phase(pb.JOB_PHASE_FAILED, "d" * DETAIL_CHARS)
    assert at_limit.status.detail == "d" * DETAIL_CHARS
    past, _ = store.create(spec("job-b"), pb.ROLE_GATEWAY)
    past.set_phase(pb.JOB_PHASE_FAILED, "e" * (DETAIL_CHARS + 1))
    assert len(past.status.detail) <= DETAIL_CHARS
    assert "remote_tpu cut" in past.status.detail
    assert past.status.detail.startswith("e" * 100)
    assert past.status.detail.endswith("e" * 100)


def test_running_then_finished_clears_the_queue_fields(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    with record.changed:
        record.status.queue_position = 3
        record.status.queued_behind = "job-z"
    record.set_phase(pb.JOB_PHASE_RUNNING)
    assert (record.status.queue_position, record.status.queued_behind) == (0, "")
    assert record.status.started_at > 0
    assert record.status.ended_at == 0
    record.set_phase(pb.JOB_PHASE_SUCCEEDED)
    assert record.finished
    assert record.status.ended_at >= record.status.started_at


def test_every_change_bumps_the_version_watchers_wait_on(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    v0 = record.version
    record.append_output(0, OUT, b"x")
    v1 = record.version
    record.set_phase(pb.JOB_PHASE_RUNNING)
    assert v0 < v1 < record.version


# ---------------------------------------------------------------- log offsets

def test_output_reads_back_in_order_with_its_stream_and_offsets(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    record.append_output(0, OUT, b"one\n")
    record.append_output(0, ERR, b"two\n")
    record.append_output(0, OUT, b"three\n")
    host_log = record.log(0)
    offsets = [FRAME + 4, 2 * FRAME + 8, 3 * FRAME + 14]
    assert host_log.read(0) == [(OUT, b"one\n", offsets[0]),
                                (ERR, b"two\n", offsets[1]),
                                (OUT, b"three\n", offsets[2])]
    assert host_log.end() == offsets[2]


def test_reading_from_a_middle_offset_returns_exactly_what_follows(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    for i in range(5):
        record.append_output(0, ERR if i % 2 else OUT, f"line {i}\n".encode())
    whole = record.log(0).read(0)
    for k in range(len(whole)):
        rest = record.log(0).read(whole[k][2])
        assert rest == whole[k + 1:]
    assert record.log(0).read(whole[-1][2]) == []
    assert [o for _, _, o in whole] == sorted({o for _, _, o in whole})


def test_a_read_limit_returns_whole_records_only(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    for _ in range(3):
        record.append_output(0, OUT, b"x" * 10)
    # room for one record and a half: one whole record, then the rest on the next read
    first = record.log(0).read(0, limit=int(1.5 * (FRAME + 10)))
    assert first == [(OUT, b"x" * 10, FRAME + 10)]
    assert len(record.log(0).read(first[-1][2])) == 2


def test_a_record_larger_than_the_read_limit_is_still_returned_whole(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    record.append_output(0, ERR, b"y" * 1000)
    assert record.log(0).read(0, limit=100) == [(ERR, b"y" * 1000, FRAME + 1000)]


def test_hosts_have_separate_logs(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    record.append_output(0, OUT, b"zero")
    record.append_output(1, ERR, b"one")
    assert record.log(0).read(0) == [(OUT, b"zero", FRAME + 4)]
    assert record.log(1).read(0) == [(ERR, b"one", FRAME + 3)]
    assert sorted(os.listdir(record.dir)) == ["host-0.log", "host-1.log"]


def test_an_empty_log_reads_nothing_and_ends_at_zero(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    assert record.log(0).read(0) == []
    assert record.log(0).end() == 0


def test_zero_bytes_of_output_store_no_record(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    record.append_output(0, OUT, b"")
    assert record.log(0).end() == 0
    assert record.log(0).read(0) == []


def test_one_byte_of_output_is_one_record(store):
    record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
    record.append_output(0, ERR, b"!")
    assert record.log(0).read(0) == [(ERR, b"!", FRAME + 1)]
    assert record.log(0).end() == FRAME + 1


def test_a_log_reopened_continues_at_its_end(tmp_path):
    path = str(tmp_path / "host-0.log")
    first = HostLog(path)
    first.append(OUT, b"before")
    first.close()
    again = HostLog(path)
    again.append(ERR, b"after")
    assert again.read(0) == [(OUT, b"before", FRAME + 6),
                             (ERR, b"after", 2 * FRAME + 11)]


# ---------------------------------------------------------------- log bounds

def test_a_record_that_fills_the_head_exactly_stays_in_it(tmp_path):
    path = str(tmp_path / "host-0.log")
    host_log = HostLog(path, max_bytes=800)           # head: 400 bytes
    host_log.append(OUT, b"a" * 195)                  # 200 bytes framed
    host_log.append(OUT, b"b" * 195)                  # 400: exactly the head
    assert os.listdir(tmp_path) == ["host-0.log"]
    assert host_log.segments() == (400, [])
    assert host_log.end() == 400


def test_a_record_one_byte_past_the_head_goes_on_in_tail_segments_of_their_size(tmp_path):
    path = str(tmp_path / "host-0.log")
    host_log = HostLog(path, max_bytes=800)           # head 400, tails of 100
    host_log.append(OUT, b"a" * 195)                  # 200 bytes framed
    host_log.append(OUT, b"b" * 196)                  # 401: one byte past the head
    assert host_log.segments() == (200, [200, 300, 400])
    assert os.path.exists(f"{path}.{200:020d}")
    assert host_log.end() == 200 + 3 * FRAME + 196
    assert host_log.read(0) == [(OUT, b"a" * 195, 200)]
    assert host_log.read(200) == [(OUT, b"b" * 95, 300)]
    assert host_log.read(400) == [(OUT, b"b" * 6, 411)]


def test_exactly_max_log_bytes_are_all_kept(tmp_path):
    path = str(tmp_path / "host-0.log")
    host_log = HostLog(path, max_bytes=800)           # head 400, four tails of 100
    host_log.append(OUT, b"h" * 395)
    for i in range(4):
        host_log.append(OUT, bytes([48 + i]) * 95)
    assert host_log.end() == 800
    assert host_log.segments() == (400, [400, 500, 600, 700])
    got = []
    offset = 0
    while True:
        records = host_log.read(offset)
        if not records:
            break
        got += [d for _, d, _ in records]
        offset = records[-1][2]
    assert got == [b"h" * 395, b"0" * 95, b"1" * 95, b"2" * 95, b"3" * 95]


def test_one_record_past_max_log_bytes_cuts_the_oldest_tail_and_says_so(tmp_path):
    path = str(tmp_path / "host-7.log")
    host_log = HostLog(path, max_bytes=800, host=7)
    host_log.append(OUT, b"h" * 395)
    for i in range(4):
        host_log.append(OUT, bytes([48 + i]) * 95)
    host_log.append(OUT, b"!")                        # 6 more bytes: a fifth tail
    assert host_log.segments() == (400, [500, 600, 700, 800])
    assert not os.path.exists(f"{path}.{400:020d}")
    assert host_log.end() == 806
    assert host_log.read(0) == [(OUT, b"h" * 395, 400)]
    [(stream, notice, after)] = host_log.read(400)
    assert stream == ERR
    assert after == 500
    assert b"about 100 bytes of host 7's output were cut here" in notice
    assert b"kept: the first 400 bytes and the last 306 (" in notice   # 3 tails of 100, 6
    assert b"up to 800 bytes of each host's log" in notice
    assert host_log.read(450)[0][2] == 500            # anywhere in the cut: one notice
    assert host_log.read(500) == [(OUT, b"1" * 95, 600)]
    assert host_log.read(800) == [(OUT, b"!", 806)]


def test_a_zero_max_log_bytes_is_raised_to_the_smallest_workable_bound(tmp_path):
    host_log = HostLog(str(tmp_path / "host-0.log"), max_bytes=0)
    assert host_log.max_bytes == 512                  # head 256, tails of 64
    for i in range(100):
        host_log.append(OUT, bytes([65 + i % 26]))
    assert host_log.read(host_log.end() - (FRAME + 1)) == [(OUT, b"V", host_log.end())]
    assert len(host_log.segments()[1]) == 4
    assert sum(_kept(tmp_path)) <= 512


def _read_all(host_log: HostLog) -> list[tuple[int, bytes, int]]:
    got, offset = [], 0
    while records := host_log.read(offset):
        got += records
        offset = records[-1][2]
    return got


def _kept(tmp_path) -> tuple[int, int]:
    """(bytes of the head file, bytes of the tail segments) on disk."""
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    head = sizes.pop("host-0.log")
    return head, sum(sizes.values())


def test_records_far_larger_than_the_bound_are_kept_within_it(tmp_path):
    """--max-log-bytes 64K with output arriving in 1 MiB records (a process
    that prints a lot at once): what is kept stays within 64 KiB, and the
    notice says what was really kept."""
    host_log = HostLog(str(tmp_path / "host-0.log"), max_bytes=64 << 10)
    pieces = [bytes([65 + i]) * (1 << 20) for i in range(3)]
    for piece in pieces:
        host_log.append(OUT, piece)
    head, tail = _kept(tmp_path)
    assert head + tail <= 64 << 10
    assert head == 32 << 10                           # the first record fills the head
    got = _read_all(host_log)
    text = b"".join(data for _, data, _ in got)
    assert text.startswith(b"A" * (head - FRAME)) and text.endswith(b"C" * 1000)
    [notice] = [data for stream, data, _ in got if stream == ERR]
    assert f"kept: the first {head:,} bytes and the last {tail:,}".encode() in notice
    assert host_log.end() > 3 << 20                   # offsets count every byte written


@pytest.mark.parametrize("extra, head_records", [(0, 1), (1, 2)])
def test_a_first_record_at_the_heads_size_or_one_past_it(tmp_path, extra, head_records):
    """A record that fills the empty head exactly stays whole; one byte more
    and that byte goes on to a tail segment: the head never holds more."""
    host_log = HostLog(str(tmp_path / "host-0.log"), max_bytes=800)    # head: 400 bytes
    data = b"x" * (400 - FRAME + extra)
    host_log.append(OUT, data)
    assert host_log.segments()[0] == 400
    got = _read_all(host_log)
    assert len(got) == head_records and b"".join(d for _, d, _ in got) == data
    assert host_log.end() == 400 + (FRAME + 1) * extra


def test_the_store_passes_its_max_log_bytes_to_every_host_log(state):
    store = JobStore(state, max_log_bytes=800)
    try:
        record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
        assert record.log(0).max_bytes == 800
        assert record.log(3).max_bytes == 800
    finally:
        store.close()


# ---------------------------------------------------------------- pruning

def test_only_the_newest_keep_finished_jobs_stay_with_their_directories(state):
    store = JobStore(state, keep=2)
    try:
        for i in range(5):
            finish(store, f"job-{i}", b"out")
        assert listed(store) == ["job-4", "job-3"]
        assert job_dirs(state) == ["job-3.gateway", "job-4.gateway"]
        assert store.get("job-0") is None
    finally:
        store.close()


def test_queued_and_running_jobs_are_never_pruned(state):
    store = JobStore(state, keep=1)
    try:
        running, _ = store.create(spec("job-run"), pb.ROLE_GATEWAY)
        running.set_phase(pb.JOB_PHASE_RUNNING)
        running.append_output(0, OUT, b"working")
        store.create(spec("job-wait"), pb.ROLE_GATEWAY)      # (no files yet: no directory)
        time.sleep(0.002)
        for i in range(3):
            finish(store, f"job-{i}", b"out")
        assert listed(store) == ["job-2", "job-wait", "job-run"]
        assert job_dirs(state) == ["job-2.gateway", "job-run.gateway"]
    finally:
        store.close()


def test_a_job_that_just_finished_is_not_pruned_at_once(state):
    store = JobStore(state, keep=1)
    try:
        running, _ = store.create(spec("job-run"), pb.ROLE_GATEWAY)
        running.set_phase(pb.JOB_PHASE_RUNNING)
        running.append_output(0, OUT, b"result is ready")
        time.sleep(0.002)
        behind, _ = store.create(spec("job-behind"), pb.ROLE_GATEWAY)
        behind.set_phase(pb.JOB_PHASE_CANCELLED, "cancelled on request")   # while queued
        running.set_phase(pb.JOB_PHASE_SUCCEEDED)
        assert "job-run" in listed(store)
        assert os.path.isdir(running.dir)
    finally:
        store.close()


def small_result(store: JobStore, job_id: str, value: bytes) -> None:
    record, _ = store.create(spec(job_id), pb.ROLE_GATEWAY)
    record.set_phase(pb.JOB_PHASE_RUNNING)
    record.keep_result(value)
    record.set_phase(pb.JOB_PHASE_SUCCEEDED, end=pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED))
    time.sleep(0.002)


def test_a_small_value_is_kept_with_its_record_not_in_a_file(state):
    store = JobStore(state)
    try:
        small_result(store, "job-a", b"\x80\x05K\x01.")
        assert job_dirs(state) == []                        # nothing written but the record
        assert store.get("job-a").stored_result() == b"\x80\x05K\x01."
    finally:
        store.close()
    again = JobStore(state)                                 # the agent restarted
    try:
        record = again.get("job-a")
        assert record.result is None                        # not read until asked for
        assert record.stored_result() == b"\x80\x05K\x01."
        record.set_phase(pb.JOB_PHASE_SUCCEEDED, end=pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED))
        assert again.get("job-a").stored_result() == b"\x80\x05K\x01."   # a save keeps it
    finally:
        again.close()


def test_small_values_count_toward_max_store_bytes(state):
    store = JobStore(state, max_store_bytes=250)
    try:
        for i in range(3):
            small_result(store, f"job-{i}", b"v" * 100)
        assert listed(store) == ["job-2", "job-1"]          # 300 bytes of values: one goes
    finally:
        store.close()


def test_jobs_exactly_at_max_store_bytes_all_stay(state):
    store = JobStore(state, max_store_bytes=300)
    try:
        for i in range(3):
            finish(store, f"job-{i}", b"o" * 95)          # 100 bytes on disk each
        assert listed(store) == ["job-2", "job-1", "job-0"]
    finally:
        store.close()


def test_one_byte_past_max_store_bytes_drops_the_oldest_job(state):
    store = JobStore(state, max_store_bytes=299)
    try:
        for i in range(3):
            finish(store, f"job-{i}", b"o" * 95)
        assert listed(store) == ["job-2", "job-1"]
        assert job_dirs(state) == ["job-1.gateway", "job-2.gateway"]
    finally:
        store.close()


def test_after_a_restart_the_jobs_kept_are_measured_again_and_still_bound_the_store(state):
    store = JobStore(state)
    try:
        for i in range(3):
            finish(store, f"job-{i}", b"o" * 95)          # 100 bytes on disk each
    finally:
        store.close()
    again = JobStore(state, max_store_bytes=250)          # restarted with less room
    try:
        finish(again, "job-3", b"o" * 95)
        assert listed(again) == ["job-3", "job-2"]          # 200 bytes stay
        assert job_dirs(state) == ["job-2.gateway", "job-3.gateway"]
        finish(again, "job-4", b"o" * 20)
        assert listed(again) == ["job-4", "job-3", "job-2"]   # 225 bytes: all fit
    finally:
        again.close()


def test_a_value_that_lands_while_its_job_is_measured_is_counted(state, monkeypatch):
    """The job's value arrives (and its size is asked for again) while the
    prune at its end is measuring its directory: the earlier measure must not
    stand for the new one."""
    import threading

    from remote_tpu_agent.jobs import store as _store

    store = JobStore(state, max_store_bytes=5 << 20)
    try:
        finish(store, "job-old", b"o" * 95)
        record, _ = store.create(spec("job-new"), pb.ROLE_GATEWAY)
        real, measuring, landed = _store._tree_size, threading.Event(), threading.Event()

        def slow_tree_size(path: str) -> int:
            size = real(path)                # measured before the value landed
            if path.endswith("job-new.gateway") and not measuring.is_set():
                measuring.set()
                landed.wait(10)
            return size
        monkeypatch.setattr(_store, "_tree_size", slow_tree_size)
        ending = threading.Thread(target=record.set_phase, args=(pb.JOB_PHASE_SUCCEEDED,),
                                  kwargs={"end": pb.JobEnd(state=pb.JOB_STATE_SUCCEEDED)})
        ending.start()
        assert measuring.wait(10)
        os.makedirs(record.dir, exist_ok=True)
        with open(os.path.join(record.dir, "result.pkl"), "wb") as f:
            f.write(b"x" * (10 << 20))       # a value of 10 MiB lands
        again = threading.Thread(target=store.measure_again, args=(record,))
        again.start()
        time.sleep(0.3)                      # (it waits for the prune under way)
        landed.set()
        ending.join(10)
        again.join(10)
        assert listed(store) == ["job-new"]  # 10 MiB counted: the older job went
    finally:
        store.close()


def test_the_newest_finished_job_stays_even_beyond_max_store_bytes(state):
    store = JobStore(state, max_store_bytes=1)
    try:
        finish(store, "job-0", b"o" * 1000)
        finish(store, "job-1", b"o" * 1000)
        assert listed(store) == ["job-1"]
        assert job_dirs(state) == ["job-1.gateway"]
        assert store.get("job-1").log(0).read(0) == [(OUT, b"o" * 1000, FRAME + 1000)]
    finally:
        store.close()


def test_keep_counts_finished_records_of_every_role_together(state):
    store = JobStore(state, keep=1)
    try:
        peer, _ = store.create(spec("job-p"), pb.ROLE_PEER)
        peer.set_phase(pb.JOB_PHASE_SUCCEEDED)
        time.sleep(0.002)
        finish(store, "job-g")
        assert listed(store, pb.ROLE_GATEWAY) == ["job-g"]
        assert listed(store, pb.ROLE_PEER) == []
    finally:
        store.close()


# ---------------------------------------------------------------- permissions

def test_the_store_is_owner_only_whatever_the_umask(state):
    old = os.umask(0)
    try:
        store = JobStore(state)
        record, _ = store.create(spec("job-a"), pb.ROLE_GATEWAY)
        record.append_output(0, OUT, b"secret")
        record.append_output(1, OUT, b"secret")
        record.set_phase(pb.JOB_PHASE_SUCCEEDED)
    finally:
        os.umask(old)
    try:
        seen_files = set()
        for directory, _, files in os.walk(state):
            assert mode(directory) == 0o700, directory
            for name in files:
                assert mode(os.path.join(directory, name)) == 0o600, name
                seen_files.add(name)
        assert {"jobs.sqlite", "jobs.sqlite-wal", "host-0.log", "host-1.log"} <= seen_files
        assert mode(os.path.join(state, "jobs")) == 0o700
        assert mode(record.dir) == 0o700
    finally:
        store.close()


def test_the_directories_made_above_the_state_dir_are_owner_only_those_there_kept(tmp_path):
    """The default state dir, ~/.local/state/remote_tpu/agent-PORT: each
    directory the agent makes on the way is 0700 (as the XDG spec asks);
    one that was there keeps its mode."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    state = home / ".local" / "state" / "remote_tpu" / "agent-8475"
    with umask(0):
        JobStore(str(state)).close()
    for made in (home / ".local", home / ".local" / "state", state.parent, state):
        assert mode(made) == 0o700, made
    assert mode(home) == 0o755


def test_an_existing_state_dir_is_made_private(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    (state / "jobs").mkdir()
    os.chmod(state / "jobs", 0o777)
    (state / "jobs.sqlite").touch()
    os.chmod(state / "jobs.sqlite", 0o644)
    store = JobStore(str(state))
    try:
        assert mode(state) == 0o700
        assert mode(state / "jobs") == 0o700
        assert mode(state / "jobs.sqlite") == 0o600
    finally:
        store.close()


def test_a_shared_sticky_directory_is_refused_as_a_state_dir(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ConfigurationError, match="is not this agent's own directory"):
        JobStore(str(shared))
    assert mode(shared) == 0o1777                 # left as it was
    assert os.listdir(shared) == []


def test_a_store_written_before_jobs_kept_their_end_opens_and_prunes(state):
    """A jobs.sqlite from an earlier agent (no ended_at column) is upgraded in
    place: its jobs are listed, and pruning orders them by creation time."""
    import sqlite3

    os.makedirs(os.path.join(state, "jobs"), mode=0o700)
    db = sqlite3.connect(os.path.join(state, "jobs.sqlite"), isolation_level=None)
    db.execute("CREATE TABLE jobs (job_id TEXT, role INTEGER, phase INTEGER, "
               "created_at REAL, spec BLOB, status BLOB, PRIMARY KEY (job_id, role))")
    for i in range(2):
        status = pb.JobStatus(job_id=f"old-{i}", phase=pb.JOB_PHASE_SUCCEEDED,
                              created_at=1000.0 + i)
        db.execute("INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
                   (f"old-{i}", pb.ROLE_GATEWAY, pb.JOB_PHASE_SUCCEEDED, 1000.0 + i,
                    spec(f"old-{i}").SerializeToString(), status.SerializeToString()))
    db.close()
    store = JobStore(state, keep=2)
    try:
        assert listed(store) == ["old-1", "old-0"]
        finish(store, "new")
        assert listed(store) == ["new", "old-1"]
    finally:
        store.close()


def _every_read(host_log: HostLog, limit: int = 1 << 20) -> list:
    """What a follower reading from 0 to the end gets, read by read."""
    out, offset = [], 0
    while batch := host_log.read(offset, limit):
        out.extend(batch)
        offset = batch[-1][2]
    return out


@pytest.mark.parametrize("max_bytes", [1 << 30, 4096])
def test_an_open_logs_followers_read_what_the_files_hold(tmp_path, max_bytes):
    """A live follower reads the newest records from memory: at every offset
    it gets what a reader of the files gets, cut notices included, whether
    the records are in memory (the newest 256 KiB), past it, or cut."""
    path = str(tmp_path / "host-0.log")
    writer = HostLog(path, max_bytes)
    sizes = [1, 17, 300, 1 << 16, 5, 1 << 17, 2]
    for i in range(60):
        writer.append(OUT if i % 3 else ERR, bytes([65 + i % 26]) * sizes[i % len(sizes)])
    from_files = HostLog(path, max_bytes)          # never written through: files only
    assert _every_read(writer) == _every_read(from_files)
    assert _every_read(writer, limit=100) == _every_read(from_files, limit=100)
    for _, _, offset in _every_read(from_files):
        assert writer.read(offset) == from_files.read(offset), offset
    assert writer.read(writer.end()) == [] == from_files.read(from_files.end())


def test_a_live_follower_reads_the_newest_records_without_the_files(tmp_path):
    """The newest records of an open log come from memory (here: still read
    with the files gone); once it is closed, from the files again."""
    path = str(tmp_path / "host-0.log")
    host_log = HostLog(path)
    host_log.append(OUT, b"old\n" * 100_000)                 # 400 KB: past the memory
    middle = host_log.end()
    host_log.append(ERR, b"new\n")
    os.unlink(path)
    assert host_log.read(middle) == [(ERR, b"new\n", middle + FRAME + 4)]
    assert host_log.read(0) == []                    # older than the memory: the files
    host_log.close()
    assert host_log.read(middle) == []


def test_time_marks_date_the_output_and_readers_skip_them(tmp_path, monkeypatch):
    monkeypatch.setattr(host_log, "MARK_SECONDS", 0.0)      # every append marked
    log = HostLog(str(tmp_path / "host-0.log"), max_bytes=1 << 20)
    before = time.time()
    for text in (b"one\n", b"two\n"):
        log.append(OUT, text)
    records = log.read(0, marks=True)
    assert [r[0] for r in records] == [host_log.TIME_MARK, OUT, host_log.TIME_MARK, OUT]
    times = [host_log.time_of(r[1]) for r in records if r[0] == host_log.TIME_MARK]
    assert before <= times[0] <= times[1] <= time.time()
    # Without marks: the output alone, at the same offsets; a read that starts
    # on a mark goes on to what follows it.
    assert log.read(0) == [r for r in records if r[0] == OUT]
    assert log.read(records[1][2], limit=FRAME + 8) == [records[3]]
    log.close()


def test_time_marks_never_go_back_and_come_at_most_every_mark_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(host_log, "MARK_SECONDS", 3600.0)
    log = HostLog(str(tmp_path / "host-0.log"), max_bytes=1 << 20)
    for _ in range(100):
        log.append(OUT, b"x")
    marks = [r for r in log.read(0, marks=True) if r[0] == host_log.TIME_MARK]
    assert len(marks) == 1                             # the first output's
    monkeypatch.setattr(host_log, "MARK_SECONDS", 0.0)
    monkeypatch.setattr(host_log.time, "time", lambda: 1.0)      # a clock set back:
    log.append(OUT, b"y")                          # dated by the last mark, none new
    records = log.read(0, marks=True)
    assert [r[0] for r in records].count(host_log.TIME_MARK) == 1
    assert records[-1][1] == b"y"
    log.close()

