"""requirements=: a virtual environment per set of requirements on this host.

Each environment is layered on the agent's own Python: a venv whose
site-packages come first, then the agent's (a ``.pth`` file adds them), so the
host's jax, libtpu and remote_tpu stay what they are and only what the
requirements add or change is installed, once per host and set of
requirements (named by their digest), with ``uv`` where the host has it, else
pip. The ``KEEP`` environments used last stay.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from remote_tpu._core import digests
from remote_tpu._core.dirs import prune_oldest
from remote_tpu._core.requirements import protected, refusal

KEEP = 4


class EnvError(Exception):
    """The environment could not be made: what the caller is told."""


class Envs:
    """This host's environments, under ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()

    def python_for(self, requirements: Sequence[str], allow_protected: bool,
                   say: Callable[[str], None]) -> str:
        """The interpreter of the environment for ``requirements`` (made first,
        its installer's output passed to ``say`` line by line); "" for none."""
        if not requirements:
            return ""
        bad = protected(requirements)
        if bad and not allow_protected:
            raise EnvError(refusal(bad))
        key = digests.of("\n".join([sys.executable, sys.version, *requirements]).encode())
        path = os.path.join(self.root, key.hex()[:24])
        python = os.path.join(path, "bin", "python")
        with self._lock:
            if not os.path.exists(os.path.join(path, ".remote_tpu-ready")):
                shutil.rmtree(path, ignore_errors=True)
                try:
                    self._make(path, python, requirements, say)
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
            os.utime(path)
            prune_oldest(self.root, KEEP, {path})
        return python

    def _make(self, path: str, python: str, requirements: Sequence[str],
              say: Callable[[str], None]) -> None:
        say(f"remote_tpu: making an environment for {len(requirements)} requirement(s) "
            f"on this host (once): {path}")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True,
                       capture_output=True, timeout=120)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        own = os.path.join(path, "lib", version, "site-packages")
        layered = [p for p in [*site.getsitepackages(), site.getusersitepackages()]
                   if os.path.isdir(p)]
        with open(os.path.join(own, "_remote_tpu_host.pth"), "w") as f:     # the host's, after
            f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in layered)
                    + "\n")
        req = os.path.join(path, "requirements.txt")
        with open(req, "w") as f:
            f.write("\n".join(requirements) + "\n")
        uv = shutil.which("uv")
        cmd = ([uv, "pip", "install", "--python", python, "-r", req] if uv else
               [sys.executable, "-m", "pip", "--python", python, "install",
                "--disable-pip-version-check", "--no-input", "-r", req])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            say(line.rstrip("\n"))
            tail = (tail + [line.rstrip("\n")])[-15:]
        if proc.wait() != 0:
            raise EnvError(f"installing the requirements failed ({os.path.basename(cmd[0])} "
                           f"exited with {proc.returncode}); its last lines:\n"
                           + "\n".join(tail))
        open(os.path.join(path, ".remote_tpu-ready"), "w").close()
