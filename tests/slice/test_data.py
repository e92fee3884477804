"""remote_tpu.Data: local data and gs:// data (a real GCS emulator) as a local
path on every host; local data staged through a bucket."""

from __future__ import annotations

import os
import pickle

import pytest

import remote_tpu
from remote_tpu import _blobs
from remote_tpu._core import gcs as gcs_copies
from remote_tpu._core.exceptions import ConfigurationError

from gcs_emulator import gcs  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180), pytest.mark.agents(after=["gcs"])]


def _on(agents, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, init_jax=False, stream="none", **kw)


def _every_host_reads(*paths_and_report):
    """Each host writes what it found at each path into the report directory
    (the last argument; the hosts share this machine); process 0's comes back."""
    import os
    *paths, report = paths_and_report

    def read(path):
        if os.path.isfile(path):
            return open(path, "rb").read().decode()
        return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f)).read()
                for d, _, fs in os.walk(path) for f in fs}
    seen = [read(p) for p in paths]
    with open(os.path.join(report, os.environ.get("JAX_PROCESS_ID", "here")), "w") as f:
        f.write(repr(seen))
    return seen


def _reports(directory) -> list:
    return [eval(open(os.path.join(directory, h)).read()) for h in sorted(os.listdir(directory))]


@pytest.fixture
def local_data(tmp_path):
    root = tmp_path / "dataset"
    (root / "shard").mkdir(parents=True)
    (root / "shard" / "0.txt").write_text("zero")
    (root / "labels.csv").write_text("a,b\n")
    (root / ".gitignore").write_text("*.csv\n")             # data: no ignore rules
    single = tmp_path / "vocab.txt"
    single.write_text("hello world")
    report = tmp_path / "report"
    report.mkdir()
    return str(root), str(single), str(report)


def test_local_data_reaches_every_host_once(agents, local_data):
    root, single, report = local_data
    fn = _on(agents)(_every_host_reads)
    before = _blobs.sent_bytes[0]
    seen = fn(remote_tpu.Data(root), remote_tpu.Data(single), report)
    assert seen == [{"shard/0.txt": "zero", "labels.csv": "a,b\n", ".gitignore": "*.csv\n"},
                    "hello world"]
    assert _reports(report) == [seen, seen]                    # host 0 and host 1 alike
    assert _blobs.sent_bytes[0] > before
    again = _blobs.sent_bytes[0]
    assert fn(remote_tpu.Data(root), remote_tpu.Data(single), report) == seen
    assert _blobs.sent_bytes[0] == again                       # nothing sent again
    assert fn.local(remote_tpu.Data(single), report) == ["hello world"]   # a path here too


def test_gcs_data_is_fetched_by_every_host_and_kept_up_to_date(gcs, agents, tmp_path):
    bucket = gcs.make_bucket("datasets")
    bucket.blob("imagenet/train/0.txt").upload_from_string("first")
    bucket.blob("imagenet/train/1.txt").upload_from_string("second")
    bucket.blob("imagenet/meta.json").upload_from_string("{}")
    report = tmp_path / "report"
    report.mkdir()
    fn = _on(agents)(_every_host_reads)
    seen = fn(remote_tpu.Data("gs://datasets/imagenet/train"),
              remote_tpu.Data("gs://datasets/imagenet/meta.json"), str(report))
    assert seen == [{"0.txt": "first", "1.txt": "second"}, "{}"]
    assert _reports(report) == [seen, seen]
    bucket.blob("imagenet/train/1.txt").upload_from_string("changed")
    bucket.blob("imagenet/train/0.txt").delete()
    again = fn(remote_tpu.Data("gs://datasets/imagenet/train"), str(report))
    assert again == [{"1.txt": "changed"}]


def test_staged_local_data_goes_through_the_bucket_once(gcs, agents, local_data):
    root, single, report = local_data
    gcs.make_bucket("staging")
    fn = _on(agents, staging="gs://staging/rt")(_every_host_reads)
    before = _blobs.sent_bytes[0]
    seen = fn(remote_tpu.Data(root), remote_tpu.Data(single), report)
    assert seen[1] == "hello world" and seen[0]["shard/0.txt"] == "zero"
    assert _blobs.sent_bytes[0] == before                      # not through the gateway
    objects = {b.name: b.generation for b in gcs.client().list_blobs("staging")}
    assert any(n.endswith("/shard/0.txt") for n in objects)
    assert sum(n.endswith(".complete") for n in objects) == 2
    fn(remote_tpu.Data(root), remote_tpu.Data(single), report)
    assert {b.name: b.generation for b in gcs.client().list_blobs("staging")} == objects


def test_bad_data_is_refused_with_what_to_do(gcs, agents, tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        remote_tpu.Data(str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="only local paths and gs://"):
        remote_tpu.Data("s3://bucket/x")
    with pytest.raises(ConfigurationError, match="give a gs://bucket/prefix"):
        _on(agents, staging="/local/dir")
    with pytest.raises(ConfigurationError, match="only be pickled as an argument"):
        pickle.dumps(remote_tpu.Data(str(tmp_path)))
    with pytest.raises(ConfigurationError) as err:             # raised on the hosts
        _on(agents)(lambda d: d)(remote_tpu.Data("gs://no-such-bucket/x"))
    assert "bucket no-such-bucket does not exist" in str(err.value)
    assert "while fetching remote_tpu.Data('gs://no-such-bucket/x')" in "".join(
        err.value.__notes__)


def _files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture
def gcs_cache(tmp_path, monkeypatch):
    cache = tmp_path / "gcs-cache"
    monkeypatch.setenv("REMOTE_TPU_GCS_CACHE", str(cache))
    return cache


# ("a/../b" and ".." alone: this emulator cannot store them; tests/test_local_names.py)
@pytest.mark.parametrize("rest", ["/ABSOLUTE", "a/./b", "a//b", "a\\b", "nul\0x"])
def test_gcs_objects_whose_names_leave_the_cache_are_refused_naming_them(
        gcs, gcs_cache, tmp_path, rest):
    outside = tmp_path / "outside.txt"
    bucket = gcs.make_bucket(f"hostile-{rest.encode().hex()[:20]}")
    name = "data/" + rest.replace("/ABSOLUTE", str(outside))
    bucket.blob(name).upload_from_string(b"replaced your file")
    bucket.blob("data/fine.txt").upload_from_string(b"fine")
    with pytest.raises(ConfigurationError) as err:
        gcs_copies.local_copy(f"gs://{bucket.name}/data")
    assert repr(f"gs://{bucket.name}/{name}") in str(err.value)    # the object, named
    assert "nothing was downloaded" in str(err.value)
    assert not outside.exists()
    assert [f for f in _files_under(gcs_cache) if not f.endswith(".lock")] == []


def test_a_gcs_object_leading_through_a_link_in_the_cache_is_refused(gcs, gcs_cache,
                                                                     tmp_path):
    bucket = gcs.make_bucket("linked")
    bucket.blob("data/fine.txt").upload_from_string(b"fine")
    tree = gcs_copies.local_copy("gs://linked/data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(tree, "sub"))           # left there by a job, say
    bucket.blob("data/sub/x.txt").upload_from_string(b"through the link")
    with pytest.raises(ConfigurationError, match="data/sub/x.txt.*symbolic link") as err:
        gcs_copies.local_copy("gs://linked/data")
    assert os.path.join(tree, "sub") in str(err.value)
    assert list(elsewhere.iterdir()) == []


def test_gcs_names_at_the_edges_that_are_fine(gcs, gcs_cache):
    bucket = gcs.make_bucket("edges")
    for name in ("data/", "data/sub/", "data/sub/f.txt", "data/.hidden", "data/a..b",
                 "database.txt", "one.txt", "one.txt.bak"):
        bucket.blob(name).upload_from_string(name.encode())
    tree = gcs_copies.local_copy("gs://edges/data/")       # folder markers: no files
    assert _files_under(tree) == [".hidden", "a..b", "sub/f.txt"]
    assert _files_under(gcs_copies.local_copy("gs://edges/data")) == _files_under(tree)
    assert open(gcs_copies.local_copy("gs://edges/one.txt")).read() == "one.txt"


def test_the_gcs_copies_directory_is_made_owner_only(gcs, tmp_path, monkeypatch):
    from conftest import mode, umask
    cache = tmp_path / "caches" / "gcs"
    monkeypatch.setenv("REMOTE_TPU_GCS_CACHE", str(cache))
    tmp_path.chmod(0o755)
    gcs.make_bucket("modes").blob("data/f.txt").upload_from_string(b"f")
    with umask(0):
        tree = gcs_copies.local_copy("gs://modes/data")
    assert open(os.path.join(tree, "f.txt")).read() == "f"
    assert mode(cache.parent) == mode(cache) == mode(tree) == 0o700
    assert mode(tmp_path) == 0o755


@pytest.mark.slow
def test_a_hostile_gcs_object_fails_the_call_naming_it(gcs, agents, tmp_path):
    outside = tmp_path / "evil"
    bucket = gcs.make_bucket("hostile-call")
    bucket.blob(f"data/{outside}").upload_from_string(b"x")
    with pytest.raises(ConfigurationError, match=f"gs://hostile-call/data/{outside}"):
        _on(agents)(lambda d: d)(remote_tpu.Data("gs://hostile-call/data"))
    assert not outside.exists()
