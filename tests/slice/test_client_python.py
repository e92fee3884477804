"""A client whose Python minor version differs from the agent's: the agent runs
on another interpreter (Python 3.12 from pyenv here), and the workers on one of
the client's version: one it was told about (--python), one on its PATH
(an environment made on it once), or none, which is refused clearly."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import remote_tpu
from conftest import ROOT
from remote_tpu._core.auth import TOKEN_ENV, new_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_OTHER = "3.12" if sys.version_info[:2] != (3, 12) else "3.11"


def _other_python() -> str | None:
    found = shutil.which(f"python{_OTHER}")
    candidates = [found] if found else []
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{_OTHER}.*/bin/"
                                                      f"python{_OTHER}")))
    for path in candidates:
        probe = subprocess.run([path, "-c", "import sys, venv; print(sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == str(tuple(
                int(x) for x in _OTHER.split("."))):
            return path
    return None


def _version(module: str) -> str:
    import importlib.metadata
    return importlib.metadata.version(module)


@pytest.fixture(scope="module")
def agent_python():
    """Python 3.12 (or 3.11) with what the agent needs; remote_tpu from this
    checkout, on its PYTHONPATH through a directory of links."""
    other = _other_python()
    if other is None:
        pytest.skip(f"no Python {_OTHER} on this machine to run the agent under")
    root = tempfile.mkdtemp(prefix="agent-py-")
    venv = os.path.join(root, "venv")
    subprocess.run([other, "-m", "venv", venv], check=True, capture_output=True)
    python = os.path.join(venv, "bin", "python")
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"grpcio=={_version('grpcio')}", f"protobuf=={_version('protobuf')}",
         "cloudpickle", "xxhash", "tenacity", "psutil", "pathspec"],
        capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot install the agent's packages on Python {_OTHER}: "
                    f"{done.stdout[-500:]}{done.stderr[-500:]}")
    shim = os.path.join(root, "shim")
    os.makedirs(shim)
    os.symlink(os.path.join(ROOT, "remote_tpu"), os.path.join(shim, "remote_tpu"))
    os.symlink(os.path.join(ROOT, "agent"), os.path.join(shim, "remote_tpu_agent"))
    yield python, shim, root
    shutil.rmtree(root, ignore_errors=True)


class _Agent:
    def __init__(self, python: str, shim: str, extra: list[str], path: str) -> None:
        self.token = new_token()
        self.state = tempfile.mkdtemp(prefix="agent-py-state-")
        self.log = os.path.join(self.state, "agent.log")
        env = {**os.environ, TOKEN_ENV: self.token, "PYTHONPATH": shim, "PATH": path}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "remote_tpu_agent", "--port", "0", "--simulate-devices", "4",
                 "--state-dir", self.state, "--log-level", "WARNING", "--spare-workers", "0",
                 "--no-python-downloads", *extra],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        line = self.proc.stdout.readline()
        assert line.startswith("remote-tpu-agent listening on "), open(self.log).read()
        self.address = line.split()[-1]

    def run(self, fn, **kw):
        return remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=self.address,
                              token=self.token, **kw)(fn)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.proc.stdout.close()
        shutil.rmtree(self.state, ignore_errors=True)


def _where():
    import sys

    import jax
    import numpy as np
    return sys.version_info[:2], jax.device_count(), float(np.sum(jax.numpy.ones(3)))


def test_an_interpreter_the_agent_was_told_about_runs_the_clients_calls(agent_python):
    python, shim, _ = agent_python
    agent = _Agent(python, shim, ["--python", sys.executable], os.path.dirname(python))
    try:
        assert agent.run(_where)() == (sys.version_info[:2], 4, 3.0)
        agent_side = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                                    capture_output=True, text=True).stdout.strip()
        assert agent_side != str(sys.version_info[:2])          # really another Python
    finally:
        agent.stop()


def test_no_interpreter_of_the_clients_version_is_refused_with_the_fix(agent_python):
    python, shim, _ = agent_python
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    agent = _Agent(python, shim, [], os.path.dirname(python))     # nothing else on PATH
    try:
        with pytest.raises(remote_tpu.VersionMismatchError) as info:
            agent.run(_where)()
        text = str(info.value)
        assert f"the client runs Python {mine} and this host's agent Python {_OTHER}" in text
        assert f"`uv python install {mine}`" in text and "--python" in text
    finally:
        agent.stop()


def test_an_interpreter_on_the_path_gets_an_environment_made_once(agent_python, capfd):
    """A bare interpreter of the client's version on the agent's PATH: the
    client's cloudpickle and the agent's jax are installed on it, once."""
    python, shim, root = agent_python
    bare = os.path.realpath(sys.base_prefix)
    mine = f"python{sys.version_info.major}.{sys.version_info.minor}"
    bin_dir = os.path.join(root, "bare-bin")
    os.makedirs(bin_dir, exist_ok=True)
    link = os.path.join(bin_dir, mine)
    if not os.path.exists(link):
        os.symlink(os.path.join(bare, "bin", mine), link)
    agent = _Agent(python, shim, [], os.pathsep.join([os.path.dirname(python), bin_dir]))
    try:
        fn = agent.run(_where, stream="all")
        assert fn() == (sys.version_info[:2], 4, 3.0)
        first = capfd.readouterr()
        assert f"making a Python {mine[6:]} environment for this client's calls" in \
            first.out + first.err
        assert fn() == (sys.version_info[:2], 4, 3.0)
        assert "making a Python" not in "".join(capfd.readouterr())
    finally:
        agent.stop()
