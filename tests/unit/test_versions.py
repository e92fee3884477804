"""The versions a process reports (``remote_tpu._core.versions``) are the ones
``importlib.metadata`` would give, read without importing it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from remote_tpu._core import versions

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", ["cloudpickle", "jax", "jaxlib", "grpcio", "protobuf",
                                  "google-cloud-storage", "google_cloud_storage", "tenacity",
                                  "remote-tpu", "remote_tpu", "typing_extensions"])
def test_the_installed_versions_are_importlib_metadatas(name):
    assert versions._dist_version(name) == importlib.metadata.version(name)


def test_a_package_not_installed_has_no_version():
    assert versions._dist_version("no-such-package-here") == ""


def _dist(where, dirname, metadata):
    os.makedirs(os.path.join(where, dirname))
    if metadata is not None:
        with open(os.path.join(where, dirname, "METADATA"), "w") as f:
            f.write(metadata)


def test_the_first_on_the_path_wins_and_names_are_normalised(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    _dist(str(first), "Some.Odd_Name-2.0.1.dist-info",
          "Metadata-Version: 2.1\nName: some-odd-name\nVersion: 2.0.1\n\nVersion: 9\n")
    _dist(str(second), "some_odd_name-1.0.dist-info",
          "Metadata-Version: 2.1\nName: some-odd-name\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(first), str(second)])
    assert versions._dist_version("some-odd-name") == "2.0.1"
    assert versions._dist_version("Some.Odd.Name") == "2.0.1"
    assert versions._dist_version("some-odd") == ""          # a prefix is not a name
    monkeypatch.setattr(sys, "path", [str(second), str(first)])
    assert versions._dist_version("some_odd_name") == "1.0"


@pytest.fixture
def no_importlib(monkeypatch):
    """Fails any lookup that reaches importlib.metadata (it must not be needed)."""
    def refuse(name):
        raise AssertionError(f"importlib.metadata was asked for {name}")
    monkeypatch.setattr(importlib.metadata, "version", refuse)


def test_a_dist_info_is_read_without_importlib_metadata(tmp_path, monkeypatch, no_importlib):
    _dist(str(tmp_path), "plain-1.0.dist-info", "Name: plain\r\nVersion: 1.0 \r\n")
    _dist(str(tmp_path), "headless-1.0.dist-info", "Name: headless\n\nVersion: 3\n")
    _dist(str(tmp_path), "broken-1.0.dist-info", None)                 # no METADATA
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert versions._dist_version("plain") == "1.0 "            # (as importlib.metadata says)
    assert versions._dist_version("headless") == ""      # (a body's "Version:" is no header)
    assert versions._dist_version("broken") == ""


def _egg_info(where, dirname, version):
    os.makedirs(os.path.join(where, dirname))
    with open(os.path.join(where, dirname, "PKG-INFO"), "w") as f:
        f.write(f"Metadata-Version: 1.1\nName: pkg\nVersion: {version}\n")


def test_what_is_not_one_dist_info_is_importlib_metadatas_to_answer(tmp_path, monkeypatch):
    """The first entry with the name's metadata answers, whatever its kind, as
    importlib.metadata has it: an .egg-info, a zip, or two candidates in one
    directory ahead of a .dist-info further on are not passed over."""
    later = tmp_path / "later"
    _dist(str(later), "pkg-9.0.dist-info", "Name: pkg\nVersion: 9.0\n")
    egg_info, both, zipped = tmp_path / "egginfo", tmp_path / "both", tmp_path / "z.zip"
    _egg_info(str(egg_info), "pkg.egg-info", "1.0")
    _egg_info(str(both), "PKG-2.0.EGG-INFO", "2.0")
    _dist(str(both), "pkg-2.0.dist-info", "Name: pkg\nVersion: 2.0\n")
    import zipfile
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("pkg-3.0.dist-info/METADATA", "Name: pkg\nVersion: 3.0\n")
    for first, version in ((egg_info, "1.0"), (both, "2.0"), (zipped, "3.0"), (later, "9.0")):
        monkeypatch.setattr(sys, "path", [str(tmp_path / "none"), str(first), str(later)])
        assert versions._dist_version("pkg") == importlib.metadata.version("pkg") == version


def test_a_worker_and_an_agent_start_without_importing_importlib_metadata():
    """What a spare imports before its call, and the agent's whole start."""
    code = ("import sys\n"
            "from remote_tpu._core import serialization, versions\n"
            "import remote_tpu_agent.server.cli, remote_tpu_agent.worker.child\n"
            "versions.local_versions()\n"
            "print(sorted(m for m in ('importlib.metadata', 'email') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, check=True).stdout
    assert out.strip() == "[]"


def test_slice_skew_names_each_field_that_differs_with_every_hosts_value():
    from remote_tpu._core.versions import skew_table, slice_skew

    base = {"remote_tpu": "0.1.0", "python": "3.11.7", "jax": "0.10.2", "jaxlib": "0.10.2",
            "libtpu": ""}
    assert slice_skew({"a": base, "b": dict(base)}) == []
    assert slice_skew({"a": base, "b": {**base, "python": "3.11.9"}}) == []   # minor alike
    said = slice_skew({"a": base, "b": {**base, "python": "3.10.12", "libtpu": "0.0.21"}})
    assert said == ["python: a 3.11.7, b 3.10.12", "libtpu: a none, b 0.0.21"], said
    table = skew_table({"host 0": base, "host 1": {**base, "jax": "0.9.0"}}).splitlines()
    assert table[0].split() == ["HOST", "REMOTE_TPU", "PYTHON", "JAX", "JAXLIB", "LIBTPU"]
    assert table[2].split() == ["host", "1", "0.1.0", "3.11.7", "0.9.0", "0.10.2", "-"]


def test_local_versions_name_jaxlib_and_libtpu_without_importlib_metadata():
    import subprocess
    import sys

    code = ("import sys; from remote_tpu._core import versions as v; d = v.local_versions(); "
            "print(sorted(d), 'importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "'jaxlib'" in out and "'libtpu'" in out and out.strip().endswith("False"), out
