"""working_dir= on real agents: the tree reaches every host and is sent
again only when it changed, large files travel alone, a warm worker moving
to another tree imports anew, an oversize tree or bad options are refused.
The client's and the agent's sides on their own: tests/unit/test_working_dir.py."""

from __future__ import annotations

import os

import pytest

import remote_tpu
from conftest import write_file
from remote_tpu import _blobs, _workdir
from remote_tpu._core import digests
from remote_tpu._core.exceptions import ConfigurationError

pytestmark = pytest.mark.timeout(180)


def _on(agents, root, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, working_dir=root, init_jax=False,
                          stream="none", **kw)


def _tree_seen():
    """What a host sees: cwd, its files, the config, a module from the tree."""
    import json
    import os
    import sys

    import helper
    files = sorted(os.path.relpath(os.path.join(d, f), ".") for d, _, fs in os.walk(".")
                   for f in fs if "__pycache__" not in d)
    return {"cwd": os.getcwd(), "first_on_path": sys.path[0] == os.getcwd(), "files": files,
            "config": json.load(open("config.json")), "answer": helper.answer()}


def test_the_tree_reaches_every_host_and_an_unchanged_one_is_not_sent_again(agents, project):
    @_on(agents, project)
    def seen():
        return _tree_seen()

    before = _blobs.sent_bytes[0]
    first = seen()
    sent = _blobs.sent_bytes[0] - before
    assert first["config"] == {"lr": 0.1} and first["answer"] == 42
    assert first["first_on_path"]
    assert first["files"] == [".gitignore", ".remote_tpu_ignore", "config.json",
                              "data/.gitignore", "data/keep.tmp", "data/train.txt",
                              "empty.txt", "helper.py"]
    tree, _ = _workdir.describe(project)
    assert os.path.basename(first["cwd"]) == tree.digest.hex()
    assert sent == sum(b.size for b in tree.blobs) > 0
    again_before = _blobs.sent_bytes[0]
    again = seen()
    assert _blobs.sent_bytes[0] == again_before                 # nothing sent the second time
    assert again == first


def test_a_changed_file_is_sent_again_and_what_a_call_changed_is_undone(agents, project):
    @_on(agents, project)
    def meddle():
        import os
        before = open("data/train.txt").read()
        open("config.json", "w").write("{}")                 # changed,
        os.remove("helper.py")                                # removed,
        os.makedirs("made/deep")                              # and added
        open("made/deep/new.txt", "w").write("new")
        return before

    assert meddle() == "one\ntwo\n"
    write_file(project, "data/train.txt", "three\n")
    before = _blobs.sent_bytes[0]

    @_on(agents, project)
    def look():
        return _tree_seen()

    seen = look()
    assert 0 < _blobs.sent_bytes[0] - before < 100             # the small files' pack only
    assert seen["config"] == {"lr": 0.1} and seen["answer"] == 42
    assert "made/deep/new.txt" not in seen["files"] and not os.path.exists(
        os.path.join(seen["cwd"], "made"))
    assert open(os.path.join(seen["cwd"], "data", "train.txt")).read() == "three\n"


def test_large_files_travel_alone_and_keep_their_mode(agents, tmp_path):
    root = str(tmp_path / "big")
    big = os.urandom(3 << 20)
    write_file(root, "weights.bin", big)
    write_file(root, "tool.sh", "#!/bin/sh\necho tool says hi\n", mode=0o755)
    tree, buffers = _workdir.describe(root)
    assert [b.size for b in tree.blobs] == [len("#!/bin/sh\necho tool says hi\n"), 3 << 20]

    @_on(agents, root)
    def use():
        import subprocess
        from remote_tpu._core import digests
        out = subprocess.run(["./tool.sh"], capture_output=True, text=True).stdout
        return out, digests.of(open("weights.bin", "rb").read())

    assert use() == ("tool says hi\n", digests.of(big))


def test_a_warm_worker_moving_to_another_tree_imports_its_modules_anew(agents, tmp_path):
    first, second = str(tmp_path / "v1"), str(tmp_path / "v2")
    write_file(first, "helper.py", "def answer():\n    return 1\n")
    write_file(second, "helper.py", "def answer():\n    return 2\n")

    def answer():
        import os

        import helper
        return helper.answer(), os.getpid()

    one = _on(agents, first, keep_warm=60)(answer)()
    two = _on(agents, second, keep_warm=60)(answer)()
    remote_tpu.release(hosts=agents.addresses[0], token=agents.token)
    assert (one[0], two[0]) == (1, 2)
    assert one[1] == two[1]                                    # the same warm worker


def test_an_oversize_tree_names_its_largest_files_and_sends_nothing(agents, tmp_path):
    root = str(tmp_path / "huge")
    with open(write_file(root, "dataset.bin"), "wb") as f:
        f.truncate(_workdir.LIMIT_BYTES + 1)                    # sparse: no disk used
    write_file(root, "train.py", "print('hi')\n")
    before = _blobs.sent_bytes[0]
    with pytest.raises(ConfigurationError) as err:
        _on(agents, root)(lambda: 1)()
    assert "dataset.bin" in str(err.value) and ".remote_tpu_ignore" in str(err.value)
    assert "over its 512.0 MiB limit" in str(err.value)
    assert _blobs.sent_bytes[0] == before
    write_file(root, ".remote_tpu_ignore", "*.bin\n")              # as the message says
    assert _on(agents, root)(lambda: sorted(__import__("os").listdir(".")))() == [
        ".remote_tpu_ignore", "train.py"]


def test_an_empty_tree_and_bad_options(agents, tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert _on(agents, empty)(lambda: __import__("os").listdir("."))() == []
    with pytest.raises(ConfigurationError, match="is not a directory"):
        _on(agents, str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="must be a path"):
        _on(agents, 42)


@pytest.fixture
def project(tmp_path):
    root = str(tmp_path / "project")
    write_file(root, "config.json", '{"lr": 0.1}')
    write_file(root, "data/train.txt", "one\ntwo\n")
    write_file(root, "helper.py", "def answer():\n    return 42\n")
    write_file(root, "empty.txt")                                   # 0 bytes
    write_file(root, ".gitignore", "build/\n*.log\n")
    write_file(root, "build/out.bin", b"\0" * 100)                  # ignored: build/
    write_file(root, "run.log", "noise")                            # ignored: *.log
    write_file(root, "data/.gitignore", "*.tmp\n!keep.tmp\n")       # a nested one, with a negation
    write_file(root, "data/scratch.tmp", "x")                       # ignored there
    write_file(root, "data/keep.tmp", "kept")                       # ... but not this one
    write_file(root, ".remote_tpu_ignore", "secrets.env\n")
    write_file(root, "secrets.env", "TOKEN=1")
    write_file(root, ".git/HEAD", "ref: refs/heads/main")           # never sent
    return root
