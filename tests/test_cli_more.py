"""The shell as a first-class citizen: `remote-tpu run` finds a script the
way a Ray job's entrypoint is found. Subprocesses of the real command against
real agents."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import Agents

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def slice_():
    agents = Agents(2)
    yield agents
    agents.stop()


def _cli(slice_, *argv: str, cwd: str | None = None, timeout: float = 120):
    env = {**os.environ, "REMOTE_TPU_TOKEN": slice_.token,
           "REMOTE_TPU_HOSTS": slice_.addresses[0], "REMOTE_TPU_ACCELERATOR": "tpu-v4-16"}
    return subprocess.run([sys.executable, "-m", "remote_tpu", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _write(path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))


# ---------------------------------------------------------------- finding the script

@pytest.mark.slow
def test_a_relative_script_is_found_in_the_working_dir(slice_, tmp_path):
    _write(tmp_path / "proj" / "train.py", """
        import os
        print("job", os.environ["REMOTE_TPU_JOB_ID"], flush=True)
        raise ValueError("from the project")
    """)
    done = _cli(slice_, "run", "--no-jax", "--working-dir", "proj", "train.py",
                cwd=str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^job train-[0-9a-f]{12}$", done.stdout, re.MULTILINE), done.stdout
    assert 'File "train.py", line 4, in <module>' in done.stderr     # as typed
    assert "ValueError: from the project" in done.stderr


@pytest.mark.slow
def test_a_script_in_both_places_runs_the_working_dirs_and_says_so(slice_, tmp_path):
    _write(tmp_path / "proj" / "train.py", 'print("the project\'s")\n')
    _write(tmp_path / "train.py", 'print("this directory\'s")\n')
    done = _cli(slice_, "run", "--no-jax", "--working-dir", "proj", "train.py",
                cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the project's" in done.stdout and "this directory's" not in done.stdout
    assert "'train.py' is both in --working-dir proj and in this directory" in done.stderr
    assert f"running {tmp_path / 'proj' / 'train.py'}, the working dir's" in done.stderr
    # The same file by two paths is no ambiguity.
    done = _cli(slice_, "run", "--no-jax", "--working-dir", ".", "train.py",
                cwd=str(tmp_path))
    assert done.returncode == 0 and "both" not in done.stderr, done.stderr


@pytest.mark.slow
def test_a_missing_script_names_every_place_looked(slice_, tmp_path):
    (tmp_path / "proj").mkdir()
    done = _cli(slice_, "run", "--working-dir", "proj", "train.py", cwd=str(tmp_path))
    assert done.returncode == 2
    assert "cannot find the script 'train.py': looked for " in done.stderr
    assert f"{tmp_path / 'proj' / 'train.py'} (in --working-dir proj)" in done.stderr
    assert f"{tmp_path / 'train.py'} (in this directory)" in done.stderr
    done = _cli(slice_, "run", "nowhere.py", cwd=str(tmp_path))
    assert done.returncode == 2
    assert f"there is no {tmp_path / 'nowhere.py'}" in done.stderr
