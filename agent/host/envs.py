"""requirements=: a virtual environment per set of requirements on this host.

Each environment is layered on the agent's own Python: a venv whose
site-packages come first, then the agent's (a ``.pth`` file adds them), so the
host's jax, libtpu and remote_tpu stay what they are and only what the
requirements add or change is installed, once per host and set of
requirements (named by their digest), with ``uv`` where the host has it, else
pip. The ``KEEP`` environments used last stay.

The requirement lines may not name jax, libtpu, cloudpickle or remote-tpu
(``_core.requirements``); what they depend on may not replace them either:
the installer is held to the versions the host has (a constraints file), so a
dependency that pins another fails the install, saying so, instead of
shadowing the host's in the job's environment.
"""

from __future__ import annotations

import os
import shutil
import site
import sys
import threading
from collections.abc import Callable, Sequence

from remote_tpu._core import digests
from remote_tpu._core.dirs import prune_oldest
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.requirements import PROTECTED, protected, refusal

from remote_tpu_agent.worker.processes import Children
from remote_tpu_agent.host.pythons import EnvError, Pythons
from remote_tpu_agent.worker.child import ENV_PYTHON

__all__ = ["EnvError", "Envs"]

KEEP = 4


class Envs:
    """This host's environments, under ``root``; ``pythons``: the
    interpreters of other Python versions (``host.pythons``)."""

    def __init__(self, root: str, pythons: Pythons | None = None) -> None:
        self.root = root
        self.pythons = pythons or Pythons(os.path.join(root, "pythons"))
        self._lock = threading.Lock()

    def for_job(self, spec: pb.JobSpec, simulate: bool, say: Callable[[str], None],
                children: Children) -> dict[str, str]:
        """What a job's worker environment needs to run it here: the
        interpreter of its requirements= environment, on the client's Python
        (``host.pythons``); {} for the agent's own. What it runs to make them runs
        as ``children``. EnvError, Stopped."""
        base = self.pythons.base(spec.client_versions, simulate, say, children)
        python = self.python_for(spec.requirements, spec.allow_jax_requirements, say,
                                 children, base)
        if base is None:
            return {ENV_PYTHON: python} if python else {}
        path = [self.pythons.shim(), *filter(None, [os.environ.get("PYTHONPATH")])]
        return {ENV_PYTHON: python or base[0], "PYTHONPATH": os.pathsep.join(path)}

    def python_for(self, requirements: Sequence[str], allow_protected: bool,
                   say: Callable[[str], None], children: Children,
                   base: tuple[str, list[str]] | None = None) -> str:
        """The interpreter of the environment for ``requirements`` (made first,
        its installer's output passed to ``say`` line by line), layered on
        ``base`` (an interpreter and its site-packages; default the agent's);
        "" for none."""
        if not requirements:
            return ""
        bad = protected(requirements)
        if bad and not allow_protected:
            raise EnvError(refusal(bad))
        base_python, base_sites = base or (sys.executable, _own_sites())
        key = digests.of("\n".join([base_python, sys.version if base is None else "",
                                    "unheld" if allow_protected else "", *requirements]
                                   ).encode())
        path = os.path.join(self.root, key.hex()[:24])
        python = os.path.join(path, "bin", "python")
        with self._lock:
            if not os.path.exists(os.path.join(path, ".remote_tpu-ready")):
                shutil.rmtree(path, ignore_errors=True)
                try:
                    self._make(path, python, requirements, say, (base_python, base_sites),
                               children, allow_protected)
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
            os.utime(path)
            prune_oldest(self.root, KEEP, {path})
        return python

    def _make(self, path: str, python: str, requirements: Sequence[str],
              say: Callable[[str], None], base: tuple[str, list[str]],
              children: Children, allow_protected: bool) -> None:
        say(f"remote_tpu: making an environment for {len(requirements)} requirement(s) "
            f"on this host (once): {path}")
        base_python, base_sites = base
        self.pythons.make_venv([base_python, "-m", "venv", "--without-pip", path], children)
        lib = os.path.join(path, "lib")
        own = os.path.join(lib, next(d for d in os.listdir(lib) if d.startswith("python")),
                           "site-packages")
        with open(os.path.join(own, "_remote_tpu_host.pth"), "w") as f:     # the base's, after
            f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in base_sites)
                    + "\n")
        req = os.path.join(path, "requirements.txt")
        held = [] if allow_protected else self._held(base_python, children)
        with open(req, "w") as f:
            f.write("\n".join(requirements) + "\n")
        with open(os.path.join(path, "constraints.txt"), "w") as f:
            f.write("".join(f"{line}\n" for line in held))
        uv = shutil.which("uv")
        cmd = ([uv, "pip", "install", "--python", python] if uv else
               [sys.executable, "-m", "pip", "--python", python, "install",
                "--disable-pip-version-check", "--no-input"])
        try:
            self.pythons.install([*cmd, "-r", req, "-c", os.path.join(path, "constraints.txt")],
                                 say, "installing the requirements", children)
        except EnvError as exc:
            raise EnvError(f"{exc}\n(held at this host's versions: {', '.join(held)}; a "
                           "requirement that needs another version of one cannot be "
                           "installed here: leave it out, or pass "
                           "allow_jax_requirements=True)" if held else str(exc)) from None
        open(os.path.join(path, ".remote_tpu-ready"), "w").close()

    def _held(self, python: str, children: Children) -> list[str]:
        """The versions of jax, libtpu, cloudpickle and remote-tpu that
        ``python`` (the environment's base) has, as ``name==version`` lines."""
        found = self.pythons.probe(python, children, PROTECTED)
        if not found:
            raise EnvError(f"could not ask {python} which jax, libtpu, cloudpickle and "
                           "remote-tpu it has (it failed, or took over 60 s): check that it "
                           "runs on this host")
        return [f"{name}=={found[name]}" for name in PROTECTED if found.get(name)]


def _own_sites() -> list[str]:
    """The agent's own site-packages, which a requirements= environment sees
    after its own."""
    return [p for p in [*site.getsitepackages(), site.getusersitepackages()]
            if os.path.isdir(p)]
