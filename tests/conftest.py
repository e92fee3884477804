"""Shared helpers. Tests run real agents on loopback and real multi-process JAX on CPU.

The tests stand in tiers, one folder each:

- ``tests/unit``: no agent; a test may start a plain interpreter or a server
  of its own on loopback, nothing that serves jobs;
- ``tests/agent``: agents' servicers in the test process (``servicers``),
  spare workers off: their RPC surface, no process started;
- ``tests/slice``: agents as processes, as a user starts them, and local
  slices; every test there is ``slow``, by its folder (a hook below).

``-m "not slow"`` runs the first two; ``scripts/test.sh`` runs them all. A
test of the first two that starts what its tier does not allow is stopped
(``_tier_keeps_its_word``). Test modules need names unique across the tiers
(pytest imports each by its bare name).

These helpers (and certs, gcs_emulator, metadata_server, package_index and
raw_calls beside them) are imported by every tier: ``from conftest import ...``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import psutil
import pytest

from remote_tpu._core.auth import TOKEN_ENV, new_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SLOW_TIERS = ("slice",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    """Every test of a slow tier is marked ``slow`` by its folder, before ``-m``
    selects (first of the hooks): a test there cannot forget its marker."""
    slow = tuple(os.path.join(TESTS, tier) + os.sep for tier in SLOW_TIERS)
    for item in items:
        if str(item.path).startswith(slow):
            item.add_marker(pytest.mark.slow)


def _tier(item) -> str:
    """The tier (folder under tests/) of a test, or ""."""
    rel = os.path.relpath(str(item.path), TESTS).split(os.sep)
    return rel[0] if len(rel) > 1 else ""


def _starts_an_agent(argv: list[str]) -> bool:
    """Whether ``argv`` runs an agent: ``-m remote_tpu_agent`` (its
    submodules, a worker say, are not one) or the ``remote-tpu-agent`` script."""
    return any(a == "-m" and b == "remote_tpu_agent" for a, b in zip(argv, argv[1:])) or \
        any(os.path.basename(a) == "remote-tpu-agent" for a in argv[:1])


@pytest.fixture(autouse=True)
def _tier_keeps_its_word(request, monkeypatch):
    """A test of tests/unit starts no agent, one of tests/agent no process at
    all: it is refused at once, saying where the test belongs."""
    tier = _tier(request.node)
    if tier in ("unit", "agent"):
        real = subprocess.Popen.__init__

        def checked(self, args, *more, **kw):
            argv = [args] if isinstance(args, (str, bytes)) else [str(a) for a in args]
            if _starts_an_agent(argv):
                raise AssertionError(f"a test in tests/{tier} started an agent, {argv[:4]}: "
                                     "tests that start agents belong in tests/slice")
            if tier == "agent":
                raise AssertionError(f"a test in tests/agent started {argv[:4]}: this tier "
                                     "starts no process (tests/unit may start a plain one)")
            real(self, args, *more, **kw)
        monkeypatch.setattr(subprocess.Popen, "__init__", checked)
    yield


def job_processes() -> list[psutil.Process]:
    """Every live worker or agent process started by remote_tpu on this machine
    by this test run (another run's, beside it, is left alone)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "remote_tpu_agent" in cmd and p.pid != os.getpid() and _of_this_run(p):
            found.append(p)
    return found


def _of_this_run(p: psutil.Process) -> bool:
    """Whether ``p`` was started by this test run: every process the tests start
    inherits this run's TMPDIR (``_private_config_home``; the agent passes it
    on to workers). One whose TMPDIR is another test run's is not ours; one we
    cannot tell is counted as ours."""
    try:
        tmp = p.environ().get("TMPDIR", "")
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return True
    ours = os.environ.get("TMPDIR", "")
    if "pytest" not in tmp or not ours:
        return True
    base = os.path.dirname(ours.rstrip("/"))
    return tmp == base or tmp.startswith(base + "/")


def is_idle_spare(p: psutil.Process) -> bool:
    """An agent's spare worker that no job has taken (it names itself
    rtpu-worker once it has its call)."""
    return "--spare" in p.cmdline() and p.name() != "rtpu-worker"


def live_workers() -> list[psutil.Process]:
    """Every live worker process that runs (or ran) a job: idle spares aside."""
    out = []
    for p in job_processes():
        try:
            if "remote_tpu_agent.worker.child" in " ".join(p.cmdline()) and not is_idle_spare(p):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def alive(p: psutil.Process) -> bool:
    """Whether ``p`` still runs: a zombie, or a process gone between two
    looks at /proc, is not alive (never raises)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def run_python(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (its own __main__), capturing output."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", ROOT), **kwargs)


def free_port() -> int:
    return free_ports(1)[0]


def _below_ephemeral() -> range:
    """Ports under the kernel's ephemeral range: no outgoing connection and no
    bind to port 0 (every agent a test starts itself) ever takes one."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every address now (each held until all
    are chosen), for something a test starts later on them. Drawn from below
    the ephemeral range: on two test workers, a port chosen there stayed free
    until its agent came up, where one of the kernel's own could be taken
    meanwhile by a connection of the other worker's."""
    socks: list[socket.socket] = []
    candidates = _below_ephemeral()
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", random.choice(candidates) if len(candidates) > 1000 else 0))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_file(root, rel: str, data: bytes | str = b"", mode: int | None = None) -> str:
    """``data`` written to ``root/rel`` (directories made on the way), with
    permission bits ``mode`` if given; its path."""
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    if mode is not None:
        os.chmod(path, mode)
    return path


def own_ip() -> str | None:
    """An IPv4 address of this machine beyond loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


class Agents:
    """Real `remote-tpu-agent` daemons on loopback, as a user would start them."""

    def __init__(self, n: int, devices: int = 2, peers: bool = True,
                 tokens: list[str] | None = None, extra: list[str] | None = None,
                 envs: list[dict[str, str]] | None = None) -> None:
        self.tokens = tokens or [new_token()] * n
        self.envs = envs or [{}] * n             # each agent's own variables, besides
        self.token = self.tokens[0]
        # Every agent's gRPC and data ports chosen at once: an agent left to
        # pick its data port itself could take one chosen here for another.
        ports = free_ports(2 * n)
        self.ports, self.data_ports = ports[:n], ports[n:]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs = []
        self.logs = []
        self.cmds = []
        self.state_dirs = [tempfile.mkdtemp(prefix=f"agent-{i}-state-") for i in range(n)]
        for i, port in enumerate(self.ports):
            cmd = [sys.executable, "-m", "remote_tpu_agent", "--port", str(port),
                   "--worker-id", str(i), "--simulate-devices", str(devices),
                   "--state-dir", self.state_dirs[i], "--log-level", "WARNING",
                   "--data-port", str(self.data_ports[i])]
            if peers:
                cmd += ["--peers", ",".join(self.addresses)]
            cmd += extra or []
            self.cmds.append(cmd)
            log = tempfile.NamedTemporaryFile(prefix=f"agent-{i}-", suffix=".log", delete=False)
            self.logs.append(log.name)
            log.close()
            self.procs.append(self._spawn(i))
        for i in range(n):
            self._await(i)

    def _spawn(self, i: int) -> subprocess.Popen:
        with open(self.logs[i], "ab") as log:
            return subprocess.Popen(self.cmds[i], stdout=subprocess.PIPE, stderr=log, text=True,
                                    env={**os.environ, **self.envs[i],
                                         TOKEN_ENV: self.tokens[i]})

    def _await(self, i: int) -> None:
        line = self.procs[i].stdout.readline()
        assert line.startswith("remote-tpu-agent listening on "), self.log(self.logs[i])

    def restart(self, i: int) -> None:
        """Start agent i again, same port and state directory (after it died)."""
        self.procs[i].wait(10)
        self.procs[i].stdout.close()
        self.procs[i] = self._spawn(i)
        self._await(i)

    @staticmethod
    def log(path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        stuck = []
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)     # faulthandler: where is it stuck?
                time.sleep(0.5)
                proc.kill()
                proc.wait()
                stuck.append(f"agent {i} ignored SIGTERM for 10 s; its log:\n"
                             + self.log(self.logs[i])[-6000:])
            proc.stdout.close()
        for path in self.logs:
            os.unlink(path)
        for path in self.state_dirs:
            shutil.rmtree(path, ignore_errors=True)
        assert not stuck, "\n".join(stuck)


class Servicers:
    """Agents whose servicers run in this process (``create_server`` on
    loopback, spare workers off), for the RPC surface: auth, health,
    refusals, tickets, listings. A job still runs in a worker process of its
    own, so the tests of this tier run none: they start no process at all.
    ``addresses``, ``data_ports``, ``token`` and ``state_dirs`` as ``Agents``
    has them."""

    def __init__(self, n: int = 2, devices: int = 2, peers: bool = True,
                 token: str | None = None, **config) -> None:
        from remote_tpu_agent.host.config import AgentConfig
        from remote_tpu_agent.server.service import create_server
        from remote_tpu_agent.wire.discovery import Slice

        self.token = token or new_token()
        # Peers are named by their ports before they bind: those are chosen
        # here; a lone agent binds port 0 and says which it got.
        ports = free_ports(n) if peers else [0] * n
        known = tuple(f"127.0.0.1:{p}" for p in ports) if peers else ()
        self.state_dirs = [tempfile.mkdtemp(prefix=f"servicer-{i}-state-") for i in range(n)]
        self.servers, self.services, self.addresses, self.data_ports = [], [], [], []
        try:
            for i in range(n):
                server, port, service = create_server(AgentConfig(
                    port=ports[i], slice=Slice(worker_id=i, peers=known, source="flags"),
                    simulate_devices=devices, token=self.token,
                    state_dir=self.state_dirs[i], spare_workers=0, **config))
                server.start()
                self.servers.append(server)
                self.services.append(service)
                self.addresses.append(f"127.0.0.1:{port}")
                port_of_data = service.parts.data_port
                self.data_ports.append(port_of_data.port if port_of_data else 0)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """As the agent's own shutdown: every job cancelled, the port closed."""
        for server, service in zip(self.servers, self.services):
            service.parts.stop_all()
            server.stop(grace=1).wait()
            service.refusals.close()
        for path in self.state_dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def servicers(request):
    """The module's in-process agents (``Servicers``), shared by its tests: two
    of a slice, or what ``pytestmark = pytest.mark.servicers(n=1, ...)`` or an
    indirect parametrisation asks for (``Servicers``' arguments)."""
    marker = request.node.get_closest_marker("servicers")
    started = Servicers(**{**(marker.kwargs if marker else {}),
                           **getattr(request, "param", {})})
    yield started
    started.stop()


@pytest.fixture
def servicer_factory():
    """In-process agents of the test's own, with settings of their own:
    ``servicer_factory(1, peers=False, max_payload_bytes=100_000)``; all are
    stopped when the test ends."""
    started: list[Servicers] = []

    def start(n: int = 2, **options) -> Servicers:
        started.append(Servicers(n, **options))
        return started[-1]
    yield start
    for one in started:
        one.stop()


def on_agents(agents: Agents, accelerator: str = "tpu-v5litepod-4", **kw):
    """``remote_tpu.run`` on these agents (the first is the gateway)."""
    import remote_tpu

    return remote_tpu.run(accelerator=accelerator, hosts=agents.addresses[0],
                          token=agents.token, **kw)


@contextlib.contextmanager
def running_agents(n: int = 2, **options) -> Iterator[Agents]:
    """``Agents(n, **options)`` for the block, stopped after it (also when
    the block killed some of them)."""
    agents = Agents(n, **options)
    try:
        yield agents
    finally:
        agents.stop()


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "agents(n=2, devices=2, peers=True, tokens=None, extra=None, after=()): "
        "the agents the module's `agents` fixture starts (Agents' arguments; `after` names "
        "fixtures to set up first, whose environment the agents then inherit)")
    config.addinivalue_line(
        "markers", "servicers(n=2, devices=2, peers=True, token=None, **config): the "
        "in-process agents the module's `servicers` fixture starts (AgentConfig fields)")


@pytest.fixture(scope="module")
def agents(request):
    """The module's agents, shared by its tests: two agents of a slice that
    know each other, or what the module asks for with
    ``pytestmark = pytest.mark.agents(n=1, peers=False, extra=[...])``, or a
    test with ``@pytest.mark.parametrize("agents", [{"n": 4}], indirect=True)``
    (the options are ``Agents``' arguments)."""
    marker = request.node.get_closest_marker("agents")
    options = {**(marker.kwargs if marker else {}), **getattr(request, "param", {})}
    for name in options.pop("after", ()):
        request.getfixturevalue(name)
    with running_agents(**options) as started:
        yield started


@pytest.fixture(scope="module")
def pair():
    """Two agents of a slice, shared by a module's tests; no spare workers (a
    test may find a job's workers by the environment they started with, and a
    spare starts before its job)."""
    with running_agents(2, devices=2, extra=["--spare-workers", "0"]) as started:
        yield started


@pytest.fixture
def fresh_memory(monkeypatch):
    """This process has not yet found any data port unreachable."""
    from remote_tpu._core import data_wire
    monkeypatch.setattr(data_wire, "_unusable", data_wire.Backoff(data_wire.RETRY_AFTER,
                                                                 data_wire.RETRY_MAX))


@pytest.fixture
def slice_factory():
    """Agents started by the test itself, when it needs its own (to kill or
    restart them, or with flags of its own): ``slice_factory(2, extra=[...])``
    returns ``Agents``; every one is stopped when the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda n=2, **options: stack.enter_context(running_agents(n, **options))


@pytest.fixture
def no_leftover_workers():
    """Fails the test if a worker process outlives it: the gateway confirms every
    host's exit before it reports, so none may be left once the call has returned."""
    yield
    assert wait_until(lambda: not live_workers(), timeout=0.5), \
        f"worker processes left behind: {[p.cmdline() for p in live_workers()]}"


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_reaches_callers():
    """A shell that starts the suite in the background (``cmd &``, no job
    control) makes it ignore SIGINT, and every process it starts inherits
    that: the Ctrl-C tests' callers would never see their Ctrl-C and hang.
    Python's own handler here means the children start with the default."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(autouse=True, scope="session")
def _private_config_home(tmp_path_factory):
    """Agents create a default token file when none is configured: never in the
    real home of whoever runs the tests."""
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config-home"))
    # Every temporary file of the tests and of the agents and clients they
    # start goes under pytest's own directory (it keeps the last three runs'):
    # what a test that fails midway leaves behind does not pile up in /tmp.
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))
    for name in ("REMOTE_TPU_TOKEN", "REMOTE_TPU_TOKEN_FILE", "REMOTE_TPU_TLS_CA",
                 "REMOTE_TPU_HOSTS"):
        os.environ.pop(name, None)
    yield
    if old is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = old


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """What a test (or a library it imports: jax sets TPU_SKIP_MDS_QUERY at
    import) puts in this process's environment does not reach the agents of
    later tests."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@contextlib.contextmanager
def umask(mask: int):
    """This process's umask set to ``mask`` for the block (0: the modes asked
    for are the modes made)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    """``path``'s permission bits (0o700, say)."""
    return os.stat(path).st_mode & 0o7777


def need_iptables() -> None:
    """Skip the test where there is no iptables, or it may not be used."""
    if shutil.which("iptables") is None:
        pytest.skip("no iptables here (install it to run this test)")
    probe = subprocess.run(["iptables", "-L", "INPUT"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no iptables here: {probe.stderr.strip()}")


@contextlib.contextmanager
def dropping(port: int):
    """Every TCP packet to or from ``port`` on this machine dropped (a network
    gone without a word: no FIN, no reset), until the block ends."""
    rules = [["-p", "tcp", "--dport", str(port), "-j", "DROP"],
             ["-p", "tcp", "--sport", str(port), "-j", "DROP"]]
    try:
        for rule in rules:
            subprocess.run(["iptables", "-I", "INPUT", *rule], check=True)
        yield
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-D", "INPUT", *rule])


def hold_open(path: str) -> subprocess.Popen:
    """A live process that is not an agent's holding ``path`` open, as libtpu would."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                             f"f = open({path!r}, 'a')\nprint('holding', flush=True)\n"
                             "time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


@pytest.fixture
def tpu_files(tmp_path):
    """A stand-in libtpu lock file (not there yet) and TPU device file."""
    lock = tmp_path / "libtpu_lockfile"
    device = tmp_path / "accel0"
    device.write_text("")
    return lock, device


def kill_process(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` if it still runs, reap it and close its stdout."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()


def terminate_all(procs: list[subprocess.Popen], timeout: float = 15) -> None:
    """SIGTERM every process at once, then reap each and close its stdout."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout)
        proc.stdout.close()
