"""working_dir=: a project tree on every host, sent by content, each call
starting from the caller's files. The client's and the agent's sides on their
own; on real agents: tests/slice/test_working_dir_on_agents.py."""

from __future__ import annotations

import os

import pytest

import remote_tpu
from conftest import write_file
from remote_tpu import _workdir
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.host import working_dirs as _workdirs


pytestmark = pytest.mark.timeout(180)


def test_a_tree_exactly_at_the_limit_passes(tmp_path):
    root = str(tmp_path / "edge")
    with open(write_file(root, "a.bin"), "wb") as f:
        f.truncate(1000)
    assert _workdir.scan(root)[0].size == 1000
    _workdir._check_size(root, _workdir.scan(root), 1000)
    with pytest.raises(ConfigurationError, match="over its"):
        _workdir._check_size(root, _workdir.scan(root), 999)


# ------------------------------------------------------- the agent's side alone

def _cached(tmp_path, data: bytes) -> str:
    path = str(tmp_path / "blob")
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_an_agent_refuses_a_tree_naming_paths_outside_itself(tmp_path):
    blob = _cached(tmp_path, b"x")
    dirs = _workdirs.WorkingDirs(str(tmp_path / "trees"))
    for bad in ("../escape", "/etc/passwd", "a/../../b", "", "a//b"):
        tree = pb.WorkingDir(files=[pb.WorkFile(path=bad, size=1)], digest=b"d" * 16,
                             blobs=[pb.BlobRef(size=1)])
        with pytest.raises(ValueError, match="outside itself"):
            dirs.place(tree, [blob])
    assert not os.path.exists(tmp_path / "escape")


def test_an_agent_refuses_every_name_the_rule_refuses_naming_it(tmp_path):
    blob = _cached(tmp_path, b"x")
    dirs = _workdirs.WorkingDirs(str(tmp_path / "trees"))
    for bad in ("..", "a/./b", "nul\0x", "a\\b", "a/"):
        tree = pb.WorkingDir(files=[pb.WorkFile(path=bad, size=1)], digest=b"d" * 16,
                             blobs=[pb.BlobRef(size=1)])
        with pytest.raises(ValueError, match="outside itself") as err:
            dirs.place(tree, [blob])
        assert repr(bad) in str(err.value)


def test_a_link_a_job_left_in_its_tree_cannot_take_a_file_elsewhere(tmp_path):
    blob = _cached(tmp_path, b"abc")
    dirs = _workdirs.WorkingDirs(str(tmp_path / "trees"))
    tree = pb.WorkingDir(files=[pb.WorkFile(path="pkg/__pycache__/sub/f.txt", size=3)],
                         blobs=[pb.BlobRef(size=3)], digest=b"e" * 16)
    placed = dirs.place(tree, [blob], job="job-1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sub = os.path.join(placed, "pkg", "__pycache__", "sub")
    _workdirs._remove(sub)
    os.symlink(elsewhere, sub)                                  # what job-1 left
    dirs.place(tree, [blob], job="job-2")
    assert list(elsewhere.iterdir()) == []
    assert not os.path.islink(sub) and open(os.path.join(sub, "f.txt")).read() == "abc"


def test_an_agent_keeps_the_last_trees_only(tmp_path):
    blob = _cached(tmp_path, b"abc")
    dirs = _workdirs.WorkingDirs(str(tmp_path / "trees"))
    placed = []
    for i in range(_workdirs.KEEP + 2):
        tree = pb.WorkingDir(files=[pb.WorkFile(path=f"f{i}", size=3)],
                             blobs=[pb.BlobRef(size=3)], digest=bytes([i]) * 16)
        placed.append(dirs.place(tree, [blob]))
        os.utime(placed[-1], (i, i))           # made in order, oldest first
    assert sorted(os.listdir(tmp_path / "trees")) == sorted(
        [os.path.basename(p) for p in placed[-_workdirs.KEEP:]] +
        [os.path.basename(p) + ".json" for p in placed[-_workdirs.KEEP:]])
    assert open(os.path.join(placed[-1], f"f{_workdirs.KEEP + 1}")).read() == "abc"


def test_what_git_would_send_is_sent(tmp_path):
    """The ignore rules as git reads them, for the idioms people use."""
    cases = [("*\n!*/\n!*.py\n", ["a.py", "sub/b.py", "sub/c.txt"], ["a.py", "sub/b.py"]),
             ("data/**\n!data/keep.txt\n", ["data/keep.txt", "data/drop.txt", "y.txt"],
              [".gitignore", "data/keep.txt", "y.txt"]),
             ("build/\n", ["build/o.bin", "build/deep/p", "src/build.py"],
              [".gitignore", "src/build.py"]),
             ("/top.txt\n", ["top.txt", "sub/top.txt"], [".gitignore", "sub/top.txt"])]
    for i, (rules, files, sent) in enumerate(cases):
        root = str(tmp_path / f"case{i}")
        write_file(root, ".gitignore", rules)
        for f in files:
            write_file(root, f, "x")
        assert [f.rel for f in _workdir.scan(root)] == sent, rules


def test_links_travel_as_what_they_point_to_and_loops_end(tmp_path):
    root = tmp_path / "linked"
    write_file(str(tmp_path), "outside/lib/mod.py", "X = 1\n")
    write_file(str(root), "main.py", "")
    os.symlink(tmp_path / "outside" / "lib", root / "lib")
    os.symlink(root, root / "loop")                             # a loop: walked once
    os.symlink(tmp_path / "gone", root / "dangling")
    with pytest.warns(UserWarning, match="loop"):
        assert [f.rel for f in _workdir.scan(str(root))] == ["lib/mod.py", "main.py"]


def test_a_link_to_a_directory_in_the_tree_keeps_both_paths(tmp_path):
    root = str(tmp_path / "aliased")
    write_file(root, "data/x.txt", "x")
    os.symlink("data", os.path.join(root, "alias"))           # sorts before its target
    os.symlink("data", os.path.join(root, "zalias"))          # and after it
    assert [f.rel for f in _workdir.scan(root)] == ["alias/x.txt", "data/x.txt",
                                                    "zalias/x.txt"]
    tree, buffers, _ = remote_tpu.Data(root)._tree()           # Data trees alike
    assert sorted(f.path for f in tree.files) == ["alias/x.txt", "data/x.txt",
                                                  "zalias/x.txt"]
    blobs = [_write_blob(tmp_path, i, bytes(b.data())) for i, b in enumerate(buffers)]
    placed = _workdirs.WorkingDirs(str(tmp_path / "trees")).place(tree, blobs)
    assert [open(os.path.join(placed, d, "x.txt")).read()     # on a host: copies
            for d in ("alias", "data", "zalias")] == ["x", "x", "x"]


def test_a_link_to_an_ancestor_is_cut_saying_so(tmp_path):
    root = str(tmp_path / "looped")
    write_file(root, "sub/f.txt", "f")
    os.symlink("..", os.path.join(root, "sub", "up"))          # sub/up/sub/up/...
    with pytest.warns(UserWarning, match=r"sub/up.* leads back to .*looped.* not followed"):
        assert [f.rel for f in _workdir.scan(root)] == ["sub/f.txt"]


def test_names_the_hosts_cannot_write_are_refused_naming_the_file(tmp_path):
    root = str(tmp_path / "names")
    write_file(root, "a\\b.txt", "x")
    with pytest.raises(ConfigurationError, match="backslash"):
        _workdir.scan(root)
    os.unlink(os.path.join(root, "a\\b.txt"))
    with open(os.path.join(os.fsencode(root), b"bad\xff.txt"), "wb"):
        pass
    with pytest.raises(ConfigurationError, match="not UTF-8"):
        _workdir.scan(root)


def test_an_agent_undoes_chmods_and_quiet_rewrites_and_read_only_directories(tmp_path):
    root = str(tmp_path / "src")
    write_file(root, "pkg/a.txt", "aaaa")
    write_file(root, "b.txt", "bb")
    tree, buffers = _workdir.describe(root)
    blobs = [_write_blob(tmp_path, i, bytes(b.data())) for i, b in enumerate(buffers)]
    dirs = _workdirs.WorkingDirs(str(tmp_path / "trees"))
    placed = dirs.place(tree, blobs, job="job-1")
    a, b = os.path.join(placed, "pkg", "a.txt"), os.path.join(placed, "b.txt")
    os.chmod(a, 0o000)                                          # chmod
    before = os.stat(b)
    with open(b, "w") as f:
        f.write("XX")                                           # same size ...
    os.utime(b, ns=(before.st_atime_ns, before.st_mtime_ns))   # ... and mtime
    write_file(placed, "pkg/out.txt", "made by the job")
    os.chmod(os.path.join(placed, "pkg"), 0o555)                # a read-only directory
    assert dirs.place(tree, blobs, job="job-1") == placed       # the same job: left alone
    assert open(b).read() == "XX"
    dirs.place(tree, blobs, job="job-2")
    assert open(a).read() == "aaaa" and os.stat(a).st_mode & 0o777 == 0o644
    assert open(b).read() == "bb"
    assert not os.path.exists(os.path.join(placed, "pkg", "out.txt"))


def _write_blob(tmp_path, i: int, data: bytes) -> str:
    path = str(tmp_path / f"blob-{i}")
    with open(path, "wb") as f:
        f.write(data)
    return path
