"""The argument cache: a call's large buffers travel apart, are passed on to
every host as they arrive, are sent once for calls that repeat them, arrive
intact at every size boundary, and a host that cannot get them is named."""

from __future__ import annotations

import glob
import os
import signal
import stat
import threading

import numpy as np
import pytest

import remote_tpu
from conftest import Agents, on_agents, running_agents, wait_until
from remote_tpu import _blobs
from remote_tpu._core.exceptions import ConfigurationError, JobFailedError
from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu_agent.host.cache_dir import default_dir

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pair_without_data_ports():
    with running_agents(2, devices=2, extra=["--spare-workers", "0", "--data-port", "-1"]) as a:
        yield a


class Sends(list):
    """The sizes of the buffers this client sent, and how many of them went
    over the gateway's data port (the others by PutBlob)."""
    over_data_port = 0


@pytest.fixture
def sends(monkeypatch):
    count = Sends()
    real_put, real_port = _blobs._put, _blobs.data_wire.put_blob

    def counted(target, ref, blob, progress=None):
        count.append(ref.size)
        return real_put(target, ref, blob, progress)

    def port(*args):
        stored = real_port(*args)
        count.over_data_port += stored is not None
        return stored
    monkeypatch.setattr(_blobs, "_put", counted)
    monkeypatch.setattr(_blobs.data_wire, "put_blob", port)
    return count


def _checksums(array: np.ndarray) -> tuple[int, int]:
    return int(array.nbytes), int(array.astype(np.uint64).sum()) if array.size else 0


def _everywhere(agents, **kw):
    """A function that checks its argument on every host (failing the job on
    any host where it arrived changed) and returns what it saw."""
    @on_agents(agents, accelerator="tpu-v4-16", stream="none", **kw)
    def check(array, expected):
        seen = (int(array.nbytes), int(array.astype("uint64").sum()) if array.size else 0)
        if seen != expected:
            raise AssertionError(f"arrived as {seen}, expected {expected}")
        array[:1] = 0          # writable, like any argument
        return seen
    return check


def _blob_files(agents, i: int) -> list[str]:
    return glob.glob(os.path.join(default_dir(agents.state_dirs[i]), "[0-9a-f]*"))


@pytest.mark.parametrize("nbytes", [0, 1, _blobs.BLOB_MIN - 1, _blobs.BLOB_MIN,
                                    _blobs.BLOB_MIN + 1, 2 * CHUNK_SIZE, 3 * CHUNK_SIZE + 7])
@pytest.mark.parametrize("via", ["data port", "gRPC"])
def test_every_size_arrives_intact_on_every_host(request, sends, nbytes, via):
    agents = request.getfixturevalue("pair" if via == "data port" else
                                     "pair_without_data_ports")
    array = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    expected = _checksums(array)
    assert _everywhere(agents)(array, expected) == expected
    assert len(sends) == (1 if nbytes >= _blobs.BLOB_MIN else 0)
    assert sends.over_data_port == (len(sends) if via == "data port" else 0)


def test_a_repeated_argument_is_sent_once_and_reaches_every_host(pair, sends):
    array = np.arange(3 << 18, dtype=np.uint32)             # 3 MiB
    expected = _checksums(array)
    check = _everywhere(pair)
    assert check(array, expected) == expected
    assert len(sends) == 1
    assert all(len(_blob_files(pair, i)) >= 1 for i in range(2))   # passed on to the peer
    assert check(array, expected) == expected
    assert check(array, expected) == expected
    assert len(sends) == 1                                   # not sent again
    twice = check.submit(array, expected)                    # submit uses it too
    assert twice.result(timeout=120) == expected and len(sends) == 1


def test_the_same_buffer_twice_in_one_call_is_sent_once(pair, sends):
    array = np.ones(2 << 20, dtype=np.uint8) * 3

    @on_agents(pair, accelerator="tpu-v4-16", stream="none")
    def both(a, b):
        return int(a.sum() + b.sum())

    assert both(array, array.copy()) == 2 * int(array.sum())
    assert len(sends) == 1


def test_an_evicted_buffer_is_sent_again(sends):
    agents = Agents(2, devices=2, extra=["--spare-workers", "0", "--cache-bytes",
                                         str(5 << 20)])
    try:
        check = _everywhere(agents)
        a = np.full(3 << 20, 1, dtype=np.uint8)
        b = np.full(3 << 20, 2, dtype=np.uint8)
        for array in (a, b, a):                  # b pushes a out (5 MiB hold one)
            assert check(array, _checksums(array)) == _checksums(array)
        assert len(sends) == 3
        assert all(len(_blob_files(agents, i)) == 1 for i in range(2))
    finally:
        agents.stop()


def test_the_cache_is_in_memory_and_gone_with_its_agent():
    agents = Agents(1, devices=2, peers=False, extra=["--spare-workers", "0"])
    directory = default_dir(agents.state_dirs[0])
    try:
        if os.path.isdir("/dev/shm"):
            assert directory.startswith("/dev/shm/")
        array = np.full(2 << 20, 4, dtype=np.uint8)
        assert on_agents(agents, accelerator="tpu-v4-8", stream="none")(
            _everywhere_body)(array, _checksums(array)) == _checksums(array)
        assert len(_blob_files(agents, 0)) == 1
    finally:
        agents.stop()
    assert not os.path.exists(directory)


def test_without_a_cache_the_buffers_travel_in_the_payload(sends):
    agents = Agents(2, devices=2, extra=["--spare-workers", "0", "--cache-bytes", "0"])
    try:
        array = np.full(2 << 20, 5, dtype=np.uint8)
        assert _everywhere(agents)(array, _checksums(array)) == _checksums(array)
        assert sends == [] and not _blob_files(agents, 0)
    finally:
        agents.stop()


def test_two_processes_per_host_share_one_copy(sends):
    agents = Agents(2, devices=4, extra=["--spare-workers", "0"])
    try:
        array = np.arange(1 << 20, dtype=np.uint16)
        check = _everywhere(agents, processes_per_host=2)
        assert check(array, _checksums(array)) == _checksums(array)
        assert [len(_blob_files(agents, i)) for i in range(2)] == [1, 1]
        assert len(sends) == 1
    finally:
        agents.stop()


@pytest.mark.slow
def test_a_peer_dying_mid_upload_fails_the_job_naming_it(sends):
    agents = Agents(2, devices=2, extra=["--spare-workers", "0"])
    try:
        peer_blobs = default_dir(agents.state_dirs[1])

        def kill_when_receiving():
            if wait_until(lambda: glob.glob(os.path.join(peer_blobs, ".incoming-*")),
                          timeout=60, interval=0.005):
                agents.procs[1].send_signal(signal.SIGKILL)
        killer = threading.Thread(target=kill_when_receiving)
        killer.start()
        array = np.full(256 << 20, 9, dtype=np.uint8)
        with pytest.raises(JobFailedError) as failed:
            _everywhere(agents)(array, _checksums(array))
        killer.join()
        text = str(failed.value)
        assert "host 1" in text and agents.addresses[1] in text, text
    finally:
        agents.stop()


@pytest.mark.slow
def test_256_mib_reaches_4_hosts_intact(sends):
    agents = Agents(4, devices=4, extra=["--spare-workers", "0"])
    try:
        array = np.random.default_rng(7).integers(0, 255, 256 << 20, dtype=np.uint8)
        check = remote_tpu.run(accelerator="tpu-v4-32", hosts=agents.addresses,
                               token=agents.token, stream="none")(_everywhere_body)
        assert check(array, _checksums(array)) == _checksums(array)
        assert len(sends) == 1
        assert all(len(_blob_files(agents, i)) == 1 for i in range(4))
    finally:
        agents.stop()


def _everywhere_body(array, expected):
    seen = (int(array.nbytes), int(array.astype("uint64").sum()))
    if seen != expected:
        raise AssertionError(f"arrived as {seen}, expected {expected}")
    return seen


def test_warm_calls_take_their_buffers_from_the_cache(pair, sends):
    @on_agents(pair, accelerator="tpu-v4-16", stream="none", keep_warm=60)
    def step(array):
        import remote_tpu
        remote_tpu.state["calls"] = remote_tpu.state.get("calls", 0) + 1
        return int(array.astype("uint64").sum()), remote_tpu.state["calls"]

    a = np.ones(2 << 20, dtype=np.uint8)
    b = a * 2
    try:
        assert step(a) == (2 << 20, 1)
        assert step(b) == (4 << 20, 2)
        assert step(a) == (2 << 20, 3)        # the same workers, a from the cache
    finally:
        step.release()
    assert len(sends) == 2


def test_buffers_that_cannot_all_stay_in_the_cache_travel_in_the_payload(sends):
    agents = Agents(2, devices=2, extra=["--spare-workers", "0", "--cache-bytes",
                                         str(5 << 20)])
    try:
        check = _everywhere(agents)
        big = np.full(6 << 20, 1, dtype=np.uint8)              # larger than the cache
        assert check(big, _checksums(big)) == _checksums(big)

        @on_agents(agents, accelerator="tpu-v4-16", stream="none")
        def pair_of(a, b):                                     # 3 + 3 MiB > 5 MiB
            return int(a.sum()) + int(b.sum())
        a, b = np.full(3 << 20, 1, dtype=np.uint8), np.full(3 << 20, 2, dtype=np.uint8)
        assert pair_of(a, b) == 9 << 20
        assert sends == []
    finally:
        agents.stop()


def test_an_upload_cut_short_leaves_nothing_behind(pair):
    """A client that goes away mid-buffer: no partial file and no reserved
    space stay behind, on the gateway or on the peer it was passing it on to."""
    from remote_tpu._core import digests
    from remote_tpu._core.channels import Credentials, stub
    from remote_tpu._core.proto import remote_tpu_pb2 as pb

    data = np.random.default_rng(3).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    ref = pb.BlobRef(digest=digests.of(data), size=len(data))
    credentials = Credentials(token=pair.token)

    sent_two, never = threading.Event(), threading.Event()

    def requests():
        yield pb.BlobChunk(blob=ref, forward_to=[pair.addresses[1]])
        yield pb.BlobChunk(data=data[:CHUNK_SIZE])
        yield pb.BlobChunk(data=data[CHUNK_SIZE:2 * CHUNK_SIZE])
        sent_two.set()
        never.wait(30)                     # ... and the caller is interrupted here
    upload = stub(pair.addresses[0], credentials).PutBlob.future(
        requests(), timeout=60, metadata=credentials.metadata)
    assert sent_two.wait(30)
    assert wait_until(lambda: len(glob.glob(os.path.join(
        default_dir(pair.state_dirs[1]), ".incoming-*"))) == 1, timeout=30)  # passed on
    upload.cancel()
    never.set()

    def partial():
        return [p for i in range(2)
                for p in glob.glob(os.path.join(default_dir(pair.state_dirs[i]), ".incoming-*"))]
    assert wait_until(lambda: not partial(), timeout=30), partial()
    presence = stub(pair.addresses[0], credentials).HaveBlobs(
        pb.BlobQuery(blobs=[ref]), timeout=10, metadata=credentials.metadata)
    assert list(presence.present) == [False]
    array = np.frombuffer(data, dtype=np.uint8).copy()         # now whole: it works
    assert _everywhere(pair)(array, _checksums(array)) == _checksums(array)


def test_a_large_value_comes_back_and_is_kept_for_later(pair):
    """A value over 1 MiB lands in memory, reaches its caller from there, and
    is moved to the job's directory for whoever asks later."""
    @on_agents(pair, accelerator="tpu-v4-16", stream="none")
    def big_value(n):
        import numpy as np
        return np.arange(n, dtype=np.uint32)

    assert int(big_value(3 << 20)[-1]) == (3 << 20) - 1         # attached
    handle = big_value.submit(16 << 20)              # 64 MiB: asked for while it moves
    first = handle.result(timeout=120)
    assert int(first[-1]) == (16 << 20) - 1
    results = os.path.join(default_dir(pair.state_dirs[0]), "results")
    assert wait_until(lambda: not os.listdir(results), timeout=30), os.listdir(results)
    again = remote_tpu.attach(handle.id, hosts=pair.addresses[0], token=pair.token)
    assert np.array_equal(again.result(timeout=60), first)
    assert os.path.exists(os.path.join(pair.state_dirs[0], "jobs", f"{handle.id}.gateway",
                                       "result.bin"))


def test_a_cache_place_too_small_for_a_buffer_or_a_value_falls_back(tmp_path, sends):
    """Where the cache's file system fills (a container's small /dev/shm, say),
    arguments travel in the payload and a large value goes to the job's
    directory: the call works all the same."""
    import subprocess
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        agents = Agents(1, devices=2, peers=False, extra=[
            "--spare-workers", "0", "--cache-dir", str(small / "cache")])
        try:
            @on_agents(agents, accelerator="tpu-v4-8", stream="none")
            def echo(array):
                return array * 1                      # a new 6 MiB value

            array = np.full(6 << 20, 3, dtype=np.uint8)
            value = echo(array)
            assert value.nbytes == 6 << 20 and int(value[0]) == 3
            assert len(sends) == 1                     # tried, refused (full), then inline
        finally:
            agents.stop()
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_the_memory_cache_of_a_killed_agent_is_removed_by_the_next_agent():
    first = Agents(1, devices=2, peers=False, extra=["--spare-workers", "0"])
    orphan = default_dir(first.state_dirs[0])
    if not orphan.startswith("/dev/shm/"):
        first.stop()
        pytest.skip("no /dev/shm of 1 GiB here: the cache lives in the state directory")
    first.procs[0].send_signal(signal.SIGKILL)       # no chance to remove its cache
    first.procs[0].wait(10)
    assert os.path.isdir(orphan)
    second = Agents(1, devices=2, peers=False, extra=["--spare-workers", "0"])
    try:
        assert not os.path.exists(orphan)
        assert os.path.isdir(default_dir(second.state_dirs[0]))   # its own stays
    finally:
        second.stop()
        first.stop()


@pytest.mark.slow
@pytest.mark.parametrize("before", ["holding a file", "empty", "missing"])
def test_a_cache_dir_given_keeps_what_was_there_and_only_its_own_goes(tmp_path, before):
    """``--cache-dir DIR`` (a mounted disk, say) is a place, not the cache:
    the agent keeps its cache in a directory of its own inside DIR and
    removes only that one; what DIR held, and DIR itself, stay."""
    place = tmp_path / "ssd"
    if before != "missing":
        place.mkdir(mode=0o755)
    if before == "holding a file":
        (place / "dataset.bin").write_bytes(b"not the agent's")
    agents = Agents(1, devices=2, peers=False,
                    extra=["--spare-workers", "0", "--cache-dir", str(place)])
    try:
        [own] = [p for p in place.iterdir() if p.name.startswith("remote-tpu-cache-")]
        assert own.is_dir() and (own / "owner").read_text() == str(agents.procs[0].pid)
        assert stat.S_IMODE(own.stat().st_mode) == 0o700
        mode = 0o700 if before == "missing" else 0o755
        assert stat.S_IMODE(place.stat().st_mode) == mode          # not changed when there
    finally:
        agents.stop()
    assert place.is_dir() and not own.exists()
    left = sorted(p.name for p in place.iterdir())
    assert left == (["dataset.bin"] if before == "holding a file" else [])
    if before == "holding a file":
        assert (place / "dataset.bin").read_bytes() == b"not the agent's"


def test_a_cache_dir_that_is_a_file_is_refused_saying_so(tmp_path):
    import subprocess
    import sys
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    done = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--port", "0",
                           "--state-dir", str(tmp_path / "state"), "--cache-dir", str(afile)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"--cache-dir {afile} is not a directory" in done.stderr, done.stderr
    assert afile.read_text() == "mine"


def test_a_peer_lacking_a_buffer_is_sent_it_from_the_gateways_cache(pair, tmp_path):
    """Before a job starts, the gateway sends each peer the buffers it lacks
    (evicted, or never passed on) from its own cache (ensure_on)."""
    from remote_tpu._core import digests
    from remote_tpu._core.channels import Credentials, stub
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu_agent.host.blob_sends import ensure_on
    from remote_tpu_agent.host.blobs import BlobCache

    data = os.urandom(3 * CHUNK_SIZE + 5)
    ref = pb.BlobRef(digest=digests.of(data), size=len(data))
    cache = BlobCache(str(tmp_path / "cache"), 1 << 30)
    credentials = Credentials(token=pair.token)
    cache.receive(iter([pb.BlobChunk(blob=ref, data=data)]), credentials, lambda: [])
    peer = pair.addresses[1]
    ask = lambda: list(stub(peer, credentials).HaveBlobs(     # noqa: E731
        pb.BlobQuery(blobs=[ref]), timeout=10, metadata=credentials.metadata).present)
    assert ask() == [False]
    assert ensure_on([peer], [ref], cache.path, credentials) == ({}, set())
    assert ask() == [True]
    assert ensure_on([peer], [ref], cache.path, credentials) == ({}, set())  # there: none sent
    cache.close()


CACHE = 4 << 20


def _trees(tmp_path, nbytes: int) -> tuple[str, remote_tpu.Data, list[int]]:
    """A working_dir and a local Data directory, one file each (each its own
    buffer: 1 MiB and more), of ``nbytes`` together; their sizes."""
    sizes = [nbytes // 2, nbytes - nbytes // 2]
    root, data = tmp_path / f"project-{nbytes}", tmp_path / f"data-{nbytes}"
    root.mkdir()
    data.mkdir()
    (root / "weights.bin").write_bytes(os.urandom(sizes[0]))
    (data / "shard.bin").write_bytes(os.urandom(sizes[1]))
    return str(root), remote_tpu.Data(str(data)), sizes


def _sizes_seen(data, array=None):
    import os
    return [os.path.getsize("weights.bin"), os.path.getsize(os.path.join(data, "shard.bin")),
            0 if array is None else int(array.nbytes)]


@pytest.fixture
def small_cache(slice_factory):
    return slice_factory(2, devices=2, extra=["--spare-workers", "0", "--cache-bytes",
                                              str(CACHE)])


def _call(agents, root, *args):
    return on_agents(agents, accelerator="tpu-v4-16", stream="none",
                     working_dir=root)(_sizes_seen)(*args)


@pytest.mark.slow
def test_working_dir_and_data_over_the_cache_together_are_refused_up_front(
        small_cache, sends, tmp_path):
    root, data, sizes = _trees(tmp_path, CACHE)              # exactly the cache: they fit
    assert _call(small_cache, root, data) == sizes + [0]
    assert sorted(sends) == sorted(sizes)

    sends.clear()
    root, data, sizes = _trees(tmp_path, CACHE + 1)          # one byte more
    with pytest.raises(ConfigurationError) as err:
        _call(small_cache, root, data)
    text = str(err.value)
    assert f"{CACHE + 1:,} bytes" in text and f"--cache-bytes {CACHE:,}" in text
    assert f"--cache-bytes {CACHE + 1} or more" in text and "staging=" in text
    assert "call again" not in text
    assert sends == []                                        # refused before sending


@pytest.mark.slow
def test_arguments_that_would_not_fit_beside_the_trees_go_inside_the_call(
        small_cache, sends, tmp_path):
    array = np.full(1 << 20, 7, dtype=np.uint8)
    root, data, sizes = _trees(tmp_path, CACHE - (1 << 20))  # with it: exactly the cache
    assert _call(small_cache, root, data, array) == sizes + [1 << 20]
    assert sorted(sends) == sorted(sizes + [1 << 20])

    sends.clear()
    array = np.full(1 << 20, 8, dtype=np.uint8)               # (not in the cache yet)
    root, data, sizes = _trees(tmp_path, CACHE - (1 << 20) + 1)   # one byte more: the
    assert _call(small_cache, root, data, array) == sizes + [1 << 20]   # array goes in
    assert sorted(sends) == sorted(sizes)                     # the call, never sent


@pytest.mark.slow
def test_a_peer_whose_cache_is_too_small_for_the_call_says_what_to_raise(
        small_cache, tmp_path):
    small_cache.procs[1].terminate()
    small_cache.cmds[1][small_cache.cmds[1].index("--cache-bytes") + 1] = str(CACHE // 2)
    small_cache.restart(1)
    root, data, sizes = _trees(tmp_path, CACHE // 2 + 1)     # fits the gateway's only
    with pytest.raises(JobFailedError) as err:
        _call(small_cache, root, data)
    text = str(err.value)
    assert small_cache.addresses[1] in text and f"--cache-bytes {CACHE // 2:,}" in text
    assert f"--cache-bytes {CACHE // 2 + 1} or more" in text
    assert "call again" not in text
