"""remote_tpu.Data: local data and gs:// data (a real GCS emulator) as a local
path on every host; local data staged through a bucket."""

from __future__ import annotations

import os
import pickle

import pytest

import remote_tpu
from remote_tpu import _blobs
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


@pytest.mark.slow
def test_a_hostile_gcs_object_fails_the_call_naming_it(gcs, agents, tmp_path):
    outside = tmp_path / "evil"
    bucket = gcs.make_bucket("hostile-call")
    bucket.blob(f"data/{outside}").upload_from_string(b"x")
    with pytest.raises(ConfigurationError, match=f"gs://hostile-call/data/{outside}"):
        _on(agents)(lambda d: d)(remote_tpu.Data("gs://hostile-call/data"))
    assert not outside.exists()
