"""A remote error as the user sees it: frames of their own script, local
module and working_dir files with real names and source lines, none of the
SDK's on the hosts and only its entry point here; `remote-tpu run` names the
script as typed and prints only its traceback and the hosts' summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import Agents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def slice_():
    agents = Agents(2)
    yield agents
    agents.stop()


def _env(slice_, **extra: str) -> dict:
    return {**os.environ, "REMOTE_TPU_TOKEN": slice_.token,
            "REMOTE_TPU_HOSTS": slice_.addresses[0], "REMOTE_TPU_ACCELERATOR": "tpu-v4-16",
            **extra}


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _project(tmp_path) -> None:
    _write(tmp_path / "rowcheck.py", """\
        def check(row):
            if row > 3:
                raise KeyError(f"no such column {row}")
            return row
    """)
    _write(tmp_path / "proj" / "lib" / "scaler.py", """\
        def scale(x):
            return x / 0
    """)
    _write(tmp_path / "main.py", """\
        import sys
        import remote_tpu
        import rowcheck

        WD = sys.argv[1] if len(sys.argv) > 1 else None

        @remote_tpu.run(init_jax=False, working_dir=WD)
        def step(n):
            total = n + 1
            if WD:
                from lib.scaler import scale
                return scale(total)
            return rowcheck.check(total)

        step(7)
    """)


def _run(slice_, tmp_path, *argv: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "main.py", *argv], cwd=tmp_path, env=_env(slice_, **env),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stderr


def test_a_local_modules_frame_and_the_scripts_show_their_lines(slice_, tmp_path):
    _project(tmp_path)
    err = _run(slice_, tmp_path)
    assert f'File "{tmp_path / "main.py"}", line 13, in step' in err, err
    assert "return rowcheck.check(total)" in err, err
    assert f'File "{tmp_path / "rowcheck.py"}", line 3, in check' in err, err
    assert 'raise KeyError(f"no such column {row}")' in err, err
    # Of the SDK: only the entry point the script called; nothing of the hosts'.
    assert err.count("remote_tpu/") == 1 and "in __call__" in err, err
    assert "worker/child.py" not in err and "worker/profile.py" not in err, err


def test_a_working_dir_file_is_named_by_its_path_in_the_project(slice_, tmp_path):
    _project(tmp_path)
    err = _run(slice_, tmp_path, str(tmp_path / "proj"))
    assert 'File "lib/scaler.py", line 2, in scale' in err and "return x / 0" in err, err
    assert "ZeroDivisionError: division by zero" in err, err


def test_one_switch_shows_the_sdks_frames(slice_, tmp_path):
    _project(tmp_path)
    err = _run(slice_, tmp_path, REMOTE_TPU_SHOW_SDK_FRAMES="1")
    assert "worker/child.py" in err and "_decorator.py" in err and "_client.py" in err, err
    assert 'raise KeyError(f"no such column {row}")' in err, err


def test_remote_tpu_run_prints_the_scripts_traceback_and_the_hosts_only(slice_, tmp_path):
    _write(tmp_path / "sub" / "bad.py", """\
        table = {}
        print(table["missing"])
    """)
    done = subprocess.run([sys.executable, "-m", "remote_tpu", "run", "sub/bad.py"],
                          cwd=tmp_path, env=_env(slice_), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    assert 'File "sub/bad.py", line 2, in <module>' in err and 'print(table["missing"])' in err
    assert "KeyError: 'missing'" in err and "host 0: failed" in err and "host 1:" in err, err
    assert "remote_tpu/" not in err and "agent/" not in err and "direct cause" not in err, err
    assert len(err.strip().splitlines()) <= 10, err


def test_a_file_that_is_only_here_names_the_fix(slice_, tmp_path):
    (tmp_path / "rows.csv").write_text("a,b\n")
    _write(tmp_path / "main.py", """\
        import remote_tpu

        @remote_tpu.run(init_jax=False)
        def count():
            with open("rows.csv") as f:          # here, not in the host's directory
                return len(f.readlines())

        count()
    """)
    err = _run(slice_, tmp_path)
    assert "FileNotFoundError" in err, err
    assert "'rows.csv' exists on this machine but not on the hosts" in err, err
    assert "working_dir=" in err and "remote_tpu.Data('rows.csv')" in err, err


def test_a_module_beside_the_script_names_working_dir(slice_, tmp_path):
    _write(tmp_path / "helper.py", "SCALE = 10\n")
    _write(tmp_path / "train.py", """\
        from helper import SCALE
        print(SCALE)
    """)
    done = subprocess.run([sys.executable, "-m", "remote_tpu", "run", "train.py"],
                          cwd=tmp_path, env=_env(slice_), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "No module named 'helper'" in done.stderr, done.stderr
    assert "'helper' is on this machine" in done.stderr and "--working-dir" in done.stderr
