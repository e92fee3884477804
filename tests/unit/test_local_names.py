"""Names from elsewhere (bucket objects, trees other machines describe, output
files) as local paths: ``remote_tpu._core.local_names``, the one rule."""

from __future__ import annotations

import os

import pytest

from remote_tpu._core.local_names import UnsafeName, local_path


@pytest.mark.parametrize("name, why", [
    ("", "is empty"), ("/etc/passwd", "is absolute"), ("..", "'..' part"),
    ("a/../../x", "'..' part"), ("a/./b", "'.' part"), (".", "'.' part"),
    ("a//b", "an empty part"), ("a/", "an empty part"), ("a\\b", "backslash"),
    ("nul\0x", "NUL"), ("/", "is absolute")])
def test_names_that_are_not_plain_relative_names_are_refused(tmp_path, name, why):
    with pytest.raises(UnsafeName, match=why) as err:
        local_path(str(tmp_path), name)
    assert repr(name) in str(err.value) and "allowed:" in str(err.value)


@pytest.mark.parametrize("name", ["a", "a/b/c.txt", ".hidden", "a..b", "...", "a/.b/c"])
def test_plain_names_land_under_the_directory(tmp_path, name):
    assert local_path(str(tmp_path), name) == os.path.join(str(tmp_path), *name.split("/"))


def test_a_name_through_a_link_leaving_the_directory_is_refused(tmp_path):
    root, outside = tmp_path / "tree", tmp_path / "outside"
    (root / "inner").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "out")
    os.symlink(outside / "f", root / "file-link")
    os.symlink("inner", root / "in")                           # stays inside: fine
    for name in ("out/x", "out/deep/x", "file-link"):
        with pytest.raises(UnsafeName, match=f"not inside .*{root / name.split('/')[0]}"):
            local_path(str(root), name)
    assert local_path(str(root), "in/x") == str(root / "in" / "x")
