"""A remote frame of the user's own code shows its real file name, line and
source line, on every cloudpickle 3.x release and on a host that never had
the file: the code travels whole and the client carries the file's text."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap

import pytest

from remote_tpu._core import serialization as ser
from remote_tpu._core import user_source

MODULE = '''\
def helper(n):
    total = n * 2
    raise ValueError(f"bad row {total}")     # the line a traceback must show
'''


def _dump_and_load(workdir, pythonpath: str = "") -> str:
    """In one fresh interpreter, pickle a call of a function from a local
    module; delete the module's file; in a second one (another directory,
    the file gone), run it and print the traceback."""
    project = workdir / "project"
    project.mkdir(parents=True)
    (project / "rowcheck.py").write_text(MODULE)
    blob = workdir / "call.bin"
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    dump = textwrap.dedent(f"""
        import sys, cloudpickle
        sys.path.insert(0, {str(project)!r})
        import rowcheck
        from remote_tpu._core import serialization as ser
        open({str(blob)!r}, "wb").write(ser.dumps_call(rowcheck.helper, (21,), {{}}).to_bytes())
        print(cloudpickle.__version__)
    """)
    made = subprocess.run([sys.executable, "-c", dump], capture_output=True, text=True,
                          timeout=60, env=env, cwd=workdir)
    assert made.returncode == 0, made.stderr
    (project / "rowcheck.py").unlink()
    load = textwrap.dedent(f"""
        import traceback
        from remote_tpu._core import serialization as ser
        fn, args, kwargs = ser.loads_call(open({str(blob)!r}, "rb").read())
        try:
            fn(*args, **kwargs)
        except ValueError:
            traceback.print_exc()
    """)
    ran = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True,
                         timeout=60, env=env, cwd=workdir)
    assert ran.returncode == 0, ran.stderr
    return made.stdout.strip() + "\n" + ran.stderr


def _assert_in_users_terms(text: str, workdir) -> None:
    path = str(workdir / "project" / "rowcheck.py")
    assert f'File "{path}", line 3, in helper' in text, text
    assert 'raise ValueError(f"bad row {total}")' in text, text
    assert "<dynamic-code>" not in text


def test_a_frame_of_a_file_the_host_never_had_shows_its_line(tmp_path):
    _assert_in_users_terms(_dump_and_load(tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("release", ["3.0.0", "3.1.2", "3.1.3"])
def test_every_cloudpickle_release_keeps_the_users_terms(tmp_path, release):
    # Installed beside the environment's packages (so it counts as installed,
    # not as the user's own code), first on the path, and removed after.
    target = tempfile.mkdtemp(prefix="_remote_tpu_test_cloudpickle_",
                              dir=sysconfig.get_paths()["purelib"])
    try:
        got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--target", target, f"cloudpickle=={release}"],
                             capture_output=True, text=True, timeout=240)
        if got.returncode != 0:
            pytest.skip(f"cannot install cloudpickle {release} here: {got.stderr[-300:]}")
        text = _dump_and_load(tmp_path / "run", pythonpath=target)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    assert text.splitlines()[0] == release          # that release did the pickling
    _assert_in_users_terms(text, tmp_path / "run")


def test_installed_files_and_big_files_travel_without_their_text(tmp_path, monkeypatch):
    small = tmp_path / "small.py"
    small.write_text("x = 1\n")
    big = tmp_path / "big.py"
    big.write_text("#" * (user_source.FILE_CHARS + 1) + "\n")
    files = user_source.Sources.of([str(small), str(big), os.__file__, "<string>"]).files
    assert files[str(small)] == ("", "x = 1\n")
    assert files[str(big)] == ("", None)           # named, too large to carry
    assert os.__file__ not in files and "<string>" not in files


def test_a_call_carries_only_the_files_of_code_sent_by_value():
    namespace: dict = {"__name__": "__main__"}
    exec(compile("def cell(x):\n    return x + 1\n", "<cell-1>", "exec"), namespace)
    import linecache
    linecache.cache["<cell-1>"] = (28, None, ["def cell(x):\n", "    return x + 1\n"], "<cell-1>")
    payload = ser.dumps_call(namespace["cell"], (1,), {})
    _, _, _, sources = ser.loads(payload.to_bytes(), what="call")
    assert sources.files == {"<cell-1>": ("", "def cell(x):\n    return x + 1\n")}
