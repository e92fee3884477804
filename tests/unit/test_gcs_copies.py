"""A host's copies of GCS data (remote_tpu/_core/gcs.py), against a real GCS
emulator and no agent: object names that would leave the cache are refused,
names at the edges are fine, the cache is owner-only. Whole calls with data=:
tests/slice/test_data.py."""

from __future__ import annotations

import os

import pytest

from gcs_emulator import gcs  # noqa: F401 - a fixture
from remote_tpu._core import gcs as gcs_copies
from remote_tpu._core.exceptions import ConfigurationError


def _files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture
def gcs_cache(tmp_path, monkeypatch):
    cache = tmp_path / "gcs-cache"
    monkeypatch.setenv("REMOTE_TPU_GCS_CACHE", str(cache))
    return cache


# ("a/../b" and ".." alone: this emulator cannot store them; tests/unit/test_local_names.py)
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
