"""Nothing lost: every byte of output reaches every reader, replies never pass
the message limit, stacks never harm a job, the store stays private and bounded,
and long streams never starve short calls. Real agents on loopback."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import remote_tpu
from conftest import Agents, on_agents, wait_until
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.proto import remote_tpu_pb2_grpc as pb_grpc
from remote_tpu._core.channels import Credentials, health

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.agents(n=1, peers=False)]
MB = 1_000_000


_on = on_agents


def _cli(agents, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_tpu", *args, "--hosts",
                           agents.addresses[0]], capture_output=True, timeout=120,
                          env={**os.environ, "REMOTE_TPU_TOKEN": agents.token})


def _attached(agents, body: str) -> subprocess.CompletedProcess:
    """Call a function attached in a fresh process; its stdout is the caller's."""
    code = (f"import sys, remote_tpu\n"
            f"@remote_tpu.run(accelerator='tpu-v5litepod-4', hosts={agents.addresses[0]!r},"
            f" token={agents.token!r})\n"
            f"def job():\n{textwrap.indent(textwrap.dedent(body), '    ')}\n"
            f"print('returned', job(), file=sys.stderr)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=240)


# ---------------------------------------------------------------- output

@pytest.mark.parametrize("size", [5 * MB, pytest.param(50 * MB, id="50MB")])
def test_output_written_at_once_reaches_every_reader_whole(agents, size):
    body = f"""
        import sys
        sys.stdout.write("".join(chr(65 + i % 26) for i in range(26)) * ({size} // 26)
                         + "z" * ({size} % 26))
        return "done"
    """
    expected = ("ABCDEFGHIJKLMNOPQRSTUVWXYZ" * (size // 26) + "z" * (size % 26)).encode()
    proc = _attached(agents, body)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert b"returned done" in proc.stderr
    assert proc.stdout == expected, f"caller got {len(proc.stdout)} of {size} bytes"

    @_on(agents)
    def detached():
        import sys
        sys.stdout.write("".join(chr(65 + i % 26) for i in range(26)) * (size // 26)
                         + "z" * (size % 26))
        return "done"
    handle = detached.submit()
    assert handle.result(timeout=120) == "done"
    assert handle.logs().encode() == expected
    assert "".join(handle.logs(follow=True)).encode() == expected
    cli = _cli(agents, "jobs", "logs", handle.id)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout == expected


def test_a_million_short_lines_all_reach_the_attached_caller_in_order(agents):
    proc = _attached(agents, """
        import sys
        write = sys.stdout.write
        for i in range(1_000_000):
            write(f"{i}\\n")
        return "done"
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split(b"\n")
    assert lines[-1] == b""
    assert len(lines) - 1 == 1_000_000, f"got {len(lines) - 1} of 1,000,000 lines"
    assert lines[:-1] == [str(i).encode() for i in range(1_000_000)]


def test_output_followed_while_the_job_writes_and_after_it_ended(agents):
    @_on(agents)
    def chatty():
        import time
        for i in range(200):
            print("x" * 20_000, i, flush=True)
            if i % 50 == 0:
                time.sleep(0.2)
    handle = chatty.submit()
    followed = "".join(handle.logs(follow=True))
    handle.wait(60)
    assert followed == handle.logs()
    assert [line.split()[-1] for line in followed.splitlines()] == \
        [str(i) for i in range(200)]


# ---------------------------------------------------------------- large replies

def test_a_2mb_exception_message_comes_back_as_itself_cut_and_saying_where(agents):
    @_on(agents)
    def fails():
        raise ValueError("x" * 2_000_000)

    with pytest.raises(ValueError) as info:
        fails()
    message = str(info.value)
    assert message.startswith("xxxx") and len(message) < 100_000
    assert "remote_tpu cut" in message and "exception.txt" in message
    handle = fails.submit()
    with pytest.raises(ValueError, match="remote_tpu cut") as again:
        handle.result(timeout=60)
    assert handle.logs() == ""                  # no flood of the caller's output
    path = os.path.join(agents.state_dirs[0], "jobs", f"{handle.id}.gateway", "exception.txt")
    assert f"the whole text is in {path} on host 0" in str(again.value)
    with open(path) as f:
        assert f.read().count("x") >= 2_000_000            # the whole text, where it says
    assert handle.status().state == "FAILED"
    listed = remote_tpu.jobs(hosts=agents.addresses[0], token=agents.token)
    assert handle.id in [j.id for j in listed]
    cli = _cli(agents, "jobs", "list")
    assert cli.returncode == 0, cli.stderr[-2000:]


def test_an_exception_that_cannot_be_rebuilt_smaller_still_names_its_type(agents):
    @_on(agents)
    def fails():
        class Picky(Exception):
            def __init__(self, *, code, text):
                super().__init__(text)
                self.code = code
        raise Picky(code=3, text="y" * 3_000_000)

    with pytest.raises(remote_tpu.RemoteError) as info:
        fails()
    assert "Picky" in str(info.value) and "remote_tpu cut" in str(info.value)


def test_a_job_end_of_many_hosts_fits_one_reply():
    from remote_tpu._core.limits import JOB_END_BYTES
    from remote_tpu_agent.gateway.reports import bound_end

    big = "z" * 64 * 1024
    hosts = [pb.HostReport(host=i, state=pb.HOST_STATE_FAILED, detail="d" * 10_000,
                           stacks="s" * 256 * 1024, last_lines=["l" * 4096] * 20,
                           exception=pb.RemoteException(type_name="builtins.ValueError",
                                                        message=big, traceback=big,
                                                        pickled=b"p" * (1 << 20)))
             for i in range(64)]
    end = pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=7, hosts=hosts)
    assert end.ByteSize() > 4 << 20
    bounded = bound_end(end, "job-1")
    assert bounded.ByteSize() <= JOB_END_BYTES
    assert bounded.hosts[7].exception.message == big          # the root cause keeps its own
    assert bounded.hosts[7].exception.pickled == b"p" * (1 << 20)
    other = bounded.hosts[3]
    assert "remote_tpu cut" in other.exception.message
    assert "exception.txt" in other.exception.message
    small = "m" * 2000                          # v5p's largest slice has 1,536 hosts
    many = pb.JobEnd(state=pb.JOB_STATE_FAILED, root_cause_host=0, hosts=[
        pb.HostReport(host=i, state=pb.HOST_STATE_FAILED, detail=small, stacks=small,
                      exception=pb.RemoteException(message=small, traceback=small))
        for i in range(1536)])
    bounded = bound_end(many, "job-2")
    assert bounded.ByteSize() <= JOB_END_BYTES and len(bounded.hosts) == 1536
    assert bounded.hosts[0].exception.message == small


def test_cut_text_at_the_edges():
    from remote_tpu._core.limits import cut_text

    assert cut_text("", 10) == ""
    assert cut_text("a", 1) == "a"
    exact = "a" * 1000
    assert cut_text(exact, 1000) == exact
    over = "a" * 500 + "b" * 501
    cut = cut_text(over, 1000, "see the log")
    assert len(cut) <= 1000 and cut.startswith("a") and cut.endswith("b")
    assert "cut 2" in cut or "cut" in cut and "1,001 characters" in cut and "see the log" in cut
    huge = cut_text("q" * 10_000_000, 64 * 1024)
    assert len(huge) <= 64 * 1024 and "10,000,000" in huge


# ---------------------------------------------------------------- stacks

def test_stacks_asked_at_any_moment_never_harm_a_job(agents):
    @_on(agents)
    def quick():
        import time
        time.sleep(1.0)
        return "ok"

    for delay in (0.0, 0.05, 0.1, 0.3):
        handle = quick.submit()
        time.sleep(delay)
        answers = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                answers.append(handle.stacks())
            except remote_tpu.RemoteTPUError as exc:    # queued or already over
                answers.append(str(exc))
            if handle.status().finished:
                break
            time.sleep(0.02)
        assert handle.result(timeout=60) == "ok", answers


# ---------------------------------------------------------------- ids, store

def test_the_store_is_owner_only_and_env_values_stay_out_of_replies(agents):
    @_on(agents, env={"MY_API_KEY": "sk-very-secret-value"})
    def uses_env():
        import os
        return len(os.environ["MY_API_KEY"])

    handle = uses_env.submit()
    assert handle.result(timeout=60) == len("sk-very-secret-value")
    state = agents.state_dirs[0]
    for directory, dirs, files in os.walk(state):
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        assert mode == 0o700, f"{directory} is {mode:04o}"
        for name in files:
            path = os.path.join(directory, name)
            mode = stat.S_IMODE(os.stat(path).st_mode)
            assert mode == 0o600, f"{path} is {mode:04o}"
    assert os.path.exists(os.path.join(state, "jobs.sqlite-wal"))
    channel = Credentials(token=agents.token).channel(agents.addresses[0])
    stub = pb_grpc.AgentStub(channel)
    metadata = (("x-remote-tpu-token", agents.token),)
    listed = stub.ListJobs(pb.ListJobsRequest(), metadata=metadata, timeout=10)
    status = stub.Status(pb.JobRef(job_id=handle.id), metadata=metadata, timeout=10)
    for reply in (listed, status):
        assert b"sk-very-secret-value" not in reply.SerializeToString()
    channel.close()


# ---------------------------------------------------------------- full disk

def _tmpfs(path: str, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           path], capture_output=True)
    return done.returncode == 0


def test_a_full_disk_fails_the_job_clearly_and_the_agent_keeps_serving(tmp_path):
    state = str(tmp_path / "small")
    if not _tmpfs(state, "6m"):
        pytest.skip("needs root and tmpfs mounts")
    agents = None
    try:
        agents = Agents(1, peers=False, extra=["--state-dir", state])
        filler = os.path.join(state, "filler")
        with open(filler, "wb") as f:          # leave about 1 MB free
            free = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
            f.write(b"\0" * max(0, free - MB))

        @_on(agents)
        def loud():
            import sys
            for _ in range(8):
                sys.stdout.write("y" * MB)
            return "done"

        with pytest.raises(remote_tpu.RemoteTPUError) as info:
            loud()
        assert f"state dir {state} is full" in str(info.value)
        assert health(agents.addresses[0], Credentials(token=agents.token),
                      timeout=5).versions.remote_tpu
        os.unlink(filler)

        @_on(agents)
        def fine():
            print("after the disk had room again")
            return 7
        assert fine() == 7
        listed = remote_tpu.jobs(hosts=agents.addresses[0], token=agents.token)
        assert [j.state for j in listed][:2] == ["SUCCEEDED", "FAILED"]
    finally:
        if agents is not None:
            agents.stop()
        subprocess.run(["umount", "-l", state], capture_output=True)


def test_a_log_over_its_cap_keeps_head_and_tail_and_says_what_was_cut(tmp_path):
    from remote_tpu_agent.jobs.host_log import HostLog

    log = HostLog(str(tmp_path / "host-0.log"), max_bytes=64 * 1024, host=0)
    for i in range(1000):
        log.append(pb.OUTPUT_STREAM_STDOUT, f"{i:05d}".encode() + b"." * 995)
    got, offset = [], 0
    while records := log.read(offset):
        for _, data, offset in records:
            got.append(data)
    text = b"".join(got)
    assert text.startswith(b"00000") and b"00999" in text
    assert b"were cut here" in text and b"--max-log-bytes" in text
    kept = sum(os.path.getsize(tmp_path / name) for name in os.listdir(tmp_path))
    assert kept <= 64 * 1024 + 8 * 1024
    numbers = [int(chunk[:5]) for chunk in got if chunk[:5].isdigit()]
    assert numbers == sorted(numbers) and numbers[0] == 0 and numbers[-1] == 999


# ---------------------------------------------------------------- threads

def test_two_hundred_followers_never_starve_short_calls():
    agents = Agents(1, peers=False)
    stop = threading.Event()
    try:
        @_on(agents)
        def long_job():
            import time
            print("started", flush=True)
            time.sleep(25)
            return "done"
        handle = long_job.submit()
        assert wait_until(lambda: handle.status().state == "RUNNING", 30)
        outcomes: list[str] = []
        lock = threading.Lock()

        def follow() -> None:
            try:
                for _ in handle.logs(follow=True):
                    pass
                result = "ended"
            except remote_tpu.RemoteTPUError as exc:
                result = str(exc)
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=follow, daemon=True) for _ in range(200)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(outcomes) >= 200 - 128, 60), len(outcomes)
        refused = [o for o in outcomes if o != "ended"]
        assert len(refused) == 200 - 128
        assert all("--max-streams" in o for o in refused), refused[:1]
        credentials = Credentials(token=agents.token)
        for _ in range(5):                  # short calls still answer at once
            started = time.monotonic()
            health(agents.addresses[0], credentials, attempts=1, timeout=3)
            assert handle.status().state == "RUNNING"
            assert time.monotonic() - started < 3
        handle.cancel()
        for t in threads:
            t.join(30)
        assert outcomes.count("ended") == 128
    finally:
        stop.set()
        agents.stop()


def test_the_store_drops_the_oldest_finished_jobs_beyond_its_size(tmp_path):
    from remote_tpu_agent.jobs.store import JobStore

    # room for three jobs of ~100 kB
    store = JobStore(str(tmp_path / "state"), keep=100, max_store_bytes=320_000)
    for i in range(6):
        record, _ = store.create(pb.JobSpec(job_id=f"job-{i}"), pb.ROLE_GATEWAY)
        record.append_output(0, pb.OUTPUT_STREAM_STDOUT, b"o" * 100_000)
        time.sleep(0.01)                     # created_at orders them
        record.set_phase(pb.JOB_PHASE_SUCCEEDED)
    kept = [s.job_id for s in store.list()]
    assert kept == ["job-5", "job-4", "job-3"], kept
    assert sorted(os.listdir(tmp_path / "state" / "jobs")) == \
        ["job-3.gateway", "job-4.gateway", "job-5.gateway"]
    store.close()


def test_an_exception_message_that_is_not_valid_utf8_comes_back_at_once(agents):
    @_on(agents, timeout=60)
    def undecodable():
        raise ValueError("bad file /tmp/\udcff")     # an f-string of an undecodable path

    started = time.monotonic()
    with pytest.raises(ValueError, match="bad file /tmp/"):
        undecodable()
    assert time.monotonic() - started < 30


def test_logs_without_follow_stop_at_the_end_as_it_is_now(agents):
    @_on(agents)
    def endless():
        import sys
        import time
        while True:
            sys.stdout.write("w" * 1_000_000 + "\n")
            time.sleep(0.01)

    handle = endless.submit()
    try:
        assert wait_until(lambda: len(handle.logs()) > 3_000_000, 60)
        started = time.monotonic()
        first = handle.logs()
        assert time.monotonic() - started < 10
        # What is there now: whole lines, and at most the start of the next one
        # (a snapshot may fall while a line is on its way).
        lines = first.split("\n")
        assert len(first) >= 3_000_000
        assert all(line == "w" * 1_000_000 for line in lines[:-1])
        assert set(lines[-1]) <= {"w"} and len(lines[-1]) < 1_000_000
    finally:
        handle.cancel()


def test_output_waiting_for_its_reader_is_bounded_and_control_events_never_wait():
    import queue

    from remote_tpu_agent.jobs.events import EventQueue

    events = EventQueue(max_output_bytes=3 << 20)
    block = pb.Event(host=0, output=pb.Output(stream=1, data=b"o" * (1 << 20)))
    put = []

    def producer() -> None:
        for _ in range(10):
            events.put(block)
            put.append(1)
    threading.Thread(target=producer, daemon=True).start()
    assert wait_until(lambda: len(put) == 3, 5)
    time.sleep(0.3)
    assert len(put) == 3                            # the writer waits for its reader
    events.put(pb.Event(host=0, done=pb.HostReport(host=0)))    # never waits
    for _ in range(3):
        assert events.get(timeout=1).HasField("output")
    assert wait_until(lambda: len(put) == 6, 5)
    events.close()                                  # nobody reads any more: no one waits
    assert wait_until(lambda: len(put) == 10, 5)
    kinds = []
    while True:
        try:
            kinds.append(events.get(timeout=0.1).WhichOneof("kind"))
        except queue.Empty:
            break
    assert "done" in kinds


def test_uploads_left_by_an_agent_that_died_are_removed_when_it_starts_again(tmp_path):
    state = tmp_path / "state"
    (state / "incoming").mkdir(parents=True, mode=0o700)
    left = state / "incoming" / "job-abc123"
    left.write_bytes(b"half a payload")
    agents = Agents(1, peers=False, extra=["--state-dir", str(state)])
    try:
        assert not left.exists()
        assert stat.S_IMODE(os.stat(state / "incoming").st_mode) == 0o700
        assert _on(agents)(lambda: 5)() == 5
        assert os.listdir(state / "incoming") == []
    finally:
        agents.stop()
