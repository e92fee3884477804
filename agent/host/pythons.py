"""The client's Python on this host: workers for a client whose Python minor
version (or cloudpickle release) differs from the agent's.

cloudpickle ships functions by value, as code objects that load only in the
Python minor version that made them, in the same cloudpickle release. A
laptop's Python rarely matches a TPU VM image's, so a job from such a client
runs its workers on an interpreter of the client's minor version, in an
environment with the client's cloudpickle:

1. an interpreter of that minor version: one the agent was told about
   (``--python PATH``, repeatable), else ``pythonX.Y`` on the agent's PATH,
   else one ``uv`` knows (``uv python find``), else one ``uv`` installs
   (``uv python install``; not with ``--no-python-downloads``);
2. used as it is when it already imports the client's cloudpickle, xxhash and
   the agent's jax release (the client's, where the agent has none); otherwise a virtual environment on it with those
   installed (``jax[tpu]`` on a TPU), made once per interpreter and set of
   versions and kept like the requirements= environments (``host.envs``);
3. the workers run on it with this agent's own ``remote_tpu`` and
   ``remote_tpu_agent`` (pure Python) first on ``PYTHONPATH``, from a
   directory of links to them (``shim``).

A host that can find none refuses the job, naming both versions and the
command that fixes it.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence

from remote_tpu._core import digests
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.versions import local_versions

from remote_tpu_agent.worker.processes import Children
from remote_tpu_agent.worker.environment import child_environment

_VERSION_OF = "import sys; print('%d.%d' % sys.version_info[:2])"
_PROBE = ("import json, sys, importlib.metadata as m\n"
          "def v(n):\n"
          "    try: return m.version(n)\n"
          "    except Exception: return ''\n"
          "import site\n"
          "names = ('cloudpickle', 'xxhash', 'jax', *sys.argv[1:])\n"
          "print(json.dumps({**{n: v(n) for n in names}, 'sites': site.getsitepackages()}))")


class EnvError(Exception):
    """A worker's environment could not be had (no interpreter for the
    client's Python, an installer failed): what the caller is told."""


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


class Pythons:
    """The interpreters this host's workers may run on, besides the agent's;
    ``env``: the environment of the installers and probes it runs (and of
    ``host.envs``'), by default ``child_environment``'s for an installer."""

    def __init__(self, root: str, known: Sequence[str] = (), downloads: bool = True,
                 env: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.known = [os.path.abspath(p) for p in known]
        self.downloads = downloads
        self.env = dict(env) if env is not None else child_environment(os.environ,
                                                                        installer=True)
        self._versions: dict[str, str] = {}
        # What base() found, per (version, cloudpickle, simulate): found once,
        # not probed again by every job (each probe is a process of its own).
        self._bases: dict[tuple[str, str, bool], tuple[str, list[str]]] = {}
        self._lock = threading.Lock()

    def wanted(self, versions: pb.Versions) -> tuple[str, str] | None:
        """(Python minor, cloudpickle release) a client with ``versions``
        needs its workers on; None when the agent's own interpreter will do."""
        ours = local_versions()
        want = (minor(versions.python), versions.cloudpickle)
        if not versions.python or want == (minor(str(ours["python"])), str(ours["cloudpickle"])):
            return None
        return want

    def interpreter(self, version: str, children: Children | None = None) -> str:
        """An interpreter of Python ``version`` (``3.12``) on this host, or
        EnvError saying how to get one. Its probes run as ``children``."""
        children = children or Children()
        for path in self.known:
            if self._version(path, children) == version:
                return path
        found = shutil.which(f"python{version}")
        if found and self._version(found, children) == version:
            return found
        uv = shutil.which("uv")
        if uv:
            found = self._uv(uv, "find", version, children)
            if not found and self.downloads:
                self._uv(uv, "install", version, children)
                found = self._uv(uv, "find", version, children)
            if found and self._version(found, children) == version:
                return found
        ours = minor(str(local_versions()["python"]))
        raise EnvError(
            f"the client runs Python {version} and this host's agent Python {ours}, and "
            f"this host has no Python {version} the agent knows of: install one "
            f"(`uv python install {version}`, or your distribution's python{version}) and "
            f"restart the agent with `--python $(uv python find {version})` (or put "
            f"python{version} on its PATH); or run the client on Python {ours}")

    def _version(self, path: str, children: Children) -> str:
        if path not in self._versions:
            try:
                out = children.run([path, "-c", _VERSION_OF], self.env, timeout=30)
                self._versions[path] = out.stdout.strip() if out.returncode == 0 else ""
            except (OSError, subprocess.TimeoutExpired):
                self._versions[path] = ""
        return self._versions[path]

    def _uv(self, uv: str, verb: str, version: str, children: Children) -> str:
        try:
            out = children.run([uv, "python", verb, version], self.env, timeout=600)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        lines = out.stdout.strip().splitlines()
        return lines[-1].strip() if out.returncode == 0 and lines and verb == "find" else ""

    def base(self, versions: pb.Versions, simulate: bool, say: Callable[[str], None],
             children: Children) -> tuple[str, list[str]] | None:
        """(interpreter, its site-packages) a job from a client with
        ``versions`` runs on, made first if need be (its processes run as
        ``children``); None: the agent's own."""
        want = self.wanted(versions)
        if want is None:
            return None
        found = self._bases.get((*want, simulate))
        if found is not None and os.path.exists(found[0]):
            return found
        found = self._base(*want, versions.jax, simulate, say, children)
        self._bases[(*want, simulate)] = found
        return found

    def _base(self, version: str, cloudpickle: str, client_jax: str, simulate: bool,
              say: Callable[[str], None], children: Children) -> tuple[str, list[str]]:
        python = self.interpreter(version, children)
        # The host's jax release (it matches its libtpu), else the client's.
        jax = str(local_versions()["jax"]) or client_jax
        probe = self.probe(python, children)
        if probe.get("cloudpickle") == cloudpickle and probe.get("xxhash") and \
                (not jax or probe.get("jax") == jax):
            return python, list(probe.get("sites", []))
        key = digests.of("\n".join([python, version, cloudpickle, jax, str(simulate)]).encode())
        path = os.path.join(self.root, f"python{version}-{key.hex()[:16]}")
        env_python = os.path.join(path, "bin", "python")
        with self._lock:
            if not os.path.exists(os.path.join(path, ".remote_tpu-ready")):
                shutil.rmtree(path, ignore_errors=True)
                try:
                    self._make(path, python, env_python, [
                        f"cloudpickle=={cloudpickle}" if cloudpickle else "cloudpickle",
                        "xxhash>=3.4",
                        *([f"jax{'' if simulate else '[tpu]'}=={jax}"] if jax else [])], say,
                        children)
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
            os.utime(path)
        return env_python, list(self.probe(env_python, children).get("sites", []))

    def _make(self, path: str, python: str, env_python: str, packages: list[str],
              say: Callable[[str], None], children: Children) -> None:
        say(f"remote_tpu: making a Python {os.path.basename(path).split('-')[0][6:]} "
            f"environment for this client's calls on this host (once): {path}")
        self.make_venv([python, "-m", "venv", path], children)
        uv = shutil.which("uv")
        cmd = ([uv, "pip", "install", "--python", env_python, *packages] if uv else
               [env_python, "-m", "pip", "install", "--disable-pip-version-check",
                "--no-input", *packages])
        self.install(cmd, say, "installing what a worker needs", children)
        open(os.path.join(path, ".remote_tpu-ready"), "w").close()

    def make_venv(self, cmd: list[str], children: Children) -> None:
        """Run ``python -m venv ...``; EnvError with its words when it fails."""
        try:
            done = children.run(cmd, self.env, timeout=300)
        except subprocess.TimeoutExpired:
            raise EnvError(f"`{' '.join(cmd)}` took over 300 s") from None
        if done.returncode:
            raise EnvError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")

    def probe(self, python: str, children: Children, names: Sequence[str] = ()) -> dict:
        """What ``python`` has: its cloudpickle, xxhash and jax releases (and
        those of ``names``; "" for none) and its site-packages; {} when it
        cannot say."""
        try:
            out = children.run([python, "-c", _PROBE, *names], self.env, timeout=60)
            return json.loads(out.stdout) if out.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return {}

    def install(self, cmd: list[str], say: Callable[[str], None], what: str,
                children: Children) -> None:
        """Run an installer, its output passed to ``say`` line by line; EnvError
        with its last lines when it fails."""
        proc = children.popen(cmd, self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
        tail: collections.deque[str] = collections.deque(maxlen=15)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                say(line.rstrip("\n"))
                tail.append(line.rstrip("\n"))
            proc.wait()
        finally:
            children.done(proc)
        if proc.returncode != 0:
            raise EnvError(f"{what} failed ({os.path.basename(cmd[0])} exited with "
                           f"{proc.returncode}); its last lines:\n" + "\n".join(tail))

    def shim(self) -> str:
        """A directory with only this agent's remote_tpu and remote_tpu_agent
        in it (links), for another interpreter's PYTHONPATH."""
        import remote_tpu

        import remote_tpu_agent

        path = os.path.join(self.root, "shim")
        os.makedirs(path, exist_ok=True)
        for module in (remote_tpu, remote_tpu_agent):
            target = os.path.dirname(os.path.abspath(module.__file__))
            link = os.path.join(path, module.__name__)
            if os.path.realpath(link) != os.path.realpath(target):
                tmp = f"{link}.{os.getpid()}.tmp"
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                os.symlink(target, tmp)
                os.replace(tmp, link)
        return path

