"""Nobody without the slice's credentials can make an agent do anything; hostile
or broken input never takes an agent down. Real agents, real TLS, real gRPC."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remote_tpu
from certs import pki  # noqa: F401 - a fixture
from conftest import Agents, free_port, is_idle_spare, own_ip, terminate_all, wait_until
from package_index import PackageIndex
from raw_calls import marking, marks, payload_spec, raw_stub, run_raw
from remote_tpu._core.auth import TOKEN_METADATA_KEY, new_token
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.channels import Credentials, health
from remote_tpu._script import run_command

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------- tokens


def test_token_from_environment_and_file(agents, tmp_path, monkeypatch):
    f = marking(tmp_path, accelerator="tpu-v4-16", hosts=agents.addresses[0])
    monkeypatch.setenv("REMOTE_TPU_TOKEN", agents.token)
    assert f() == "ran"
    monkeypatch.delenv("REMOTE_TPU_TOKEN")
    token_file = tmp_path / "token"
    token_file.write_text(agents.token + "\n")
    token_file.chmod(0o644)
    monkeypatch.setenv("REMOTE_TPU_TOKEN_FILE", str(token_file))
    with pytest.raises(remote_tpu.ConfigurationError, match="chmod 600"):
        f()
    token_file.chmod(0o600)
    assert f() == "ran"


@pytest.mark.slow
def test_gateway_with_another_slices_token_is_refused_by_the_peer(tmp_path):
    agents = Agents(2, tokens=[new_token(), new_token()])
    try:
        f = marking(tmp_path, accelerator="tpu-v4-16", hosts=agents.addresses[0],
                     token=agents.tokens[0])
        with pytest.raises(remote_tpu.JobFailedError) as info:
            f()
        err = info.value
        assert err.host == 1
        assert f"agent at {agents.addresses[1]} cannot take the job" in str(err)
        assert "refused this client's credentials" in str(err)
        assert "host 0: never started" in str(err)
        assert marks(tmp_path) == []      # not even the gateway's own host ran it
    finally:
        agents.stop()


def test_token_init_creates_a_private_file_once(tmp_path):
    path = tmp_path / "cfg" / "token"
    cmd = [sys.executable, "-m", "remote_tpu_agent", "token", "init", "--path", str(path)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) >= 32
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "already exists; pass --force" in again.stderr
    forced = subprocess.run(cmd + ["--force"], capture_output=True, text=True, timeout=30)
    assert forced.returncode == 0


def test_agent_refuses_a_token_file_others_can_read(tmp_path):
    path = tmp_path / "token"
    path.write_text(new_token())
    path.chmod(0o640)
    proc = subprocess.run([sys.executable, "-m", "remote_tpu_agent", "--port", "0",
                           "--token-file", str(path)], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and f"chmod 600 {path}" in proc.stderr


# -------------------------------------------------------------------- TLS


def _tls_agents(pki, mtls: bool) -> Agents:
    cert, key = pki["server"]
    extra = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(pki["ca"].path)]
    return Agents(1, extra=extra + (["--mtls"] if mtls else []), peers=False)


@pytest.mark.slow
def test_tls_client_verifies_the_agent_against_its_ca(pki, tmp_path):
    agents = _tls_agents(pki, mtls=False)
    try:
        kw = dict(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0], token=agents.token)
        ok = marking(tmp_path, tls=remote_tpu.TLS(ca=str(pki["ca"].path)), **kw)
        assert ok() == "ran"
        forged = marking(tmp_path, tls=remote_tpu.TLS(ca=str(pki["rogue"].path)), **kw)
        with pytest.raises(remote_tpu.AgentUnavailableError,
                           match="the TLS handshake with the agent at .* failed") as err:
            forged()
        assert "CERTIFICATE_VERIFY_FAILED" in str(err.value)
        assert "names the CA that signed the agent's certificate" in str(err.value)
        plaintext = marking(tmp_path, **kw)       # said at once, not retried for 15 s
        start = time.monotonic()
        with pytest.raises(remote_tpu.AgentUnavailableError, match="speaks TLS") as err:
            plaintext()
        assert time.monotonic() - start < 10
        assert "tls=remote_tpu.TLS(ca=...)" in str(err.value)
        assert marks(tmp_path) == ["ran-on-0"]
    finally:
        agents.stop()


@pytest.mark.slow
def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(pki, tmp_path):
    agents = _tls_agents(pki, mtls=True)
    ca = str(pki["ca"].path)
    kw = dict(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0], token=agents.token)
    try:
        # Refused at once, and said why: gRPC sees only "Socket closed", as of an
        # agent restarting, but is not left to retry for 15 s and blame the agent.
        for tls, why in ((remote_tpu.TLS(ca=ca), "sends no certificate"),
                         (remote_tpu.TLS(ca=ca, cert=pki["rogue_client"][0],
                                         key=pki["rogue_client"][1]),
                          "a certificate it does not accept")):
            start = time.monotonic()
            with pytest.raises(remote_tpu.AuthenticationError, match=why) as err:
                marking(tmp_path, tls=tls, **kw)()
            assert time.monotonic() - start < 10
            assert "cert=..., key=..." in str(err.value)
            with pytest.raises(remote_tpu.AuthenticationError, match=why):   # (multislice,
                health(agents.addresses[0], Credentials(agents.token, tls))   # version)
        assert marks(tmp_path) == []
        cert, key = pki["client"]
        assert marking(tmp_path, tls=remote_tpu.TLS(ca=ca, cert=cert, key=key), **kw)() == "ran"
    finally:
        agents.stop()


# ------------------------------------------------------------ exposed binds


def _start(args, timeout=30):
    return subprocess.run([sys.executable, "-m", "remote_tpu_agent", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_non_loopback_bind_needs_tls_or_insecure(pki, tmp_path):
    proc = _start(["--host", "0.0.0.0", "--port", "0"])
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0 without TLS" in proc.stderr
    assert "--insecure" in proc.stderr and "the token stays required" in proc.stderr
    cert, key = pki["server"]
    proc = subprocess.Popen([sys.executable, "-m", "remote_tpu_agent", "--host", "0.0.0.0",
                             "--port", "0", "--tls-cert", cert, "--tls-key", key],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("remote-tpu-agent listening on 0.0.0.0:")
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_insecure_agent_on_all_interfaces_still_demands_the_token(tmp_path):
    """--insecure allows plaintext beyond loopback, never calls without the token:
    with none configured the agent creates one, as without --insecure."""
    config = tmp_path / "config"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTE_TPU_")}
    env["XDG_CONFIG_HOME"] = str(config)
    proc = subprocess.Popen([sys.executable, "-m", "remote_tpu_agent", "--host", "0.0.0.0",
                             "--port", "0", "--insecure", "--state-dir", str(tmp_path / "s")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("remote-tpu-agent listening on 0.0.0.0:"), line
        address = f"127.0.0.1:{line.strip().rsplit(':', 1)[1]}"
        token_file = config / "remote_tpu" / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        channel, stub = raw_stub(address)
        with channel:
            with pytest.raises(grpc.RpcError) as info:
                stub.Health(pb.HealthRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Run(iter([pb.RunRequest(spec=payload_spec(b"x"))]), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            token = token_file.read_text().strip()
            reply = stub.Health(pb.HealthRequest(), timeout=10,
                                metadata=((TOKEN_METADATA_KEY, token),))
            assert reply.versions.remote_tpu == remote_tpu.__version__
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "*** INSECURE: no TLS on 0.0.0.0" in err and "token is required" in err
    assert f"no slice token was configured: created {token_file}" in err


class _From:
    """A TCP relay on 127.0.0.1 whose connections reach ``target`` from the
    loopback address ``source`` (127.0.0.2, say): another peer, as the agent
    sees it."""

    def __init__(self, source: str, target: tuple[str, int]) -> None:
        self._source, self._target = source, target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self._server.accept()
            except OSError:
                return                              # closed
            outbound = socket.create_connection(self._target, source_address=(self._source, 0))
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()


@pytest.mark.slow
def test_refused_calls_name_their_peer_and_repeats_are_counted_not_logged(tmp_path):
    """2,000 calls without the token from two peers: each peer is named in
    one line at once, and its other refusals in one line with their count (at
    the latest when the agent stops), not one line each."""
    proc = subprocess.Popen([sys.executable, "-m", "remote_tpu_agent", "--host", "0.0.0.0",
                             "--port", "0", "--insecure", "--spare-workers", "0",
                             "--state-dir", str(tmp_path / "s")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    relays = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("remote-tpu-agent listening on 0.0.0.0:"), line
        port = int(line.strip().rsplit(":", 1)[1])
        relays = [_From(source, ("127.0.0.1", port)) for source in ("127.0.0.1", "127.0.0.2")]

        def knock(address: str) -> None:
            channel, stub = raw_stub(address)
            with channel:
                for _ in range(1000):
                    with pytest.raises(grpc.RpcError) as info:
                        stub.Health(pb.HealthRequest(), timeout=10)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        knockers = [threading.Thread(target=knock, args=(r.address,)) for r in relays]
        for t in knockers:
            t.start()
        for t in knockers:
            t.join(120)
    finally:
        for relay in relays:
            relay.close()
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    refused = [line for line in err.splitlines() if "refused" in line]
    for peer in ("127.0.0.1", "127.0.0.2"):
        mine = [line for line in refused if f" from {peer}" in line]
        assert len(mine) == 2, refused
        assert "Health" in mine[0] and "no slice token" in mine[0], mine
        assert f"refused 999 more calls from {peer}" in mine[1], mine
    assert len(refused) == 4, refused


# ---------------------------------------------------- plaintext from clients


@pytest.mark.slow
def test_plaintext_warnings_go_to_stderr_and_the_agent_log_once(tmp_path):
    """A real slice on this machine's own non-loopback address, with --insecure:
    the client warns on stderr (never stdout), the gateway logs one warning per
    peer however many times it calls it, and REMOTE_TPU_REQUIRE_TLS=1 refuses."""
    ip = own_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    token, ports = new_token(), [free_port(), free_port()]
    addresses = [f"{ip}:{p}" for p in ports]
    env = {**os.environ, "REMOTE_TPU_TOKEN": token}
    logs = [tmp_path / f"agent-{i}.log" for i in range(2)]
    procs = []
    try:
        for i, port in enumerate(ports):
            with open(logs[i], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "remote_tpu_agent", "--host", ip, "--port",
                     str(port), "--insecure", "--worker-id", str(i), "--peers",
                     ",".join(addresses), "--state-dir", str(tmp_path / f"state-{i}")],
                    stdout=subprocess.PIPE, stderr=log, text=True, env=env))
        for proc in procs:
            assert proc.stdout.readline().startswith("remote-tpu-agent listening on")
        doctor = [sys.executable, "-m", "remote_tpu", "doctor", addresses[0]]
        for _ in range(2):
            done = subprocess.run(doctor, env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "has no TLS" not in done.stdout
            assert done.stderr.count(f"agent at {addresses[0]} has no TLS") == 1, done.stderr
        gateway_log = logs[0].read_text()
        assert gateway_log.count(f"agent at {addresses[1]} has no TLS") == 1, gateway_log
        assert "WARNING py.warnings" in gateway_log       # a log record, with the agent's format
        refused = subprocess.run(doctor, env={**env, "REMOTE_TPU_REQUIRE_TLS": "1"},
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0
        assert "refusing to connect without TLS" in refused.stdout + refused.stderr
    finally:
        terminate_all(procs, 10)


# ------------------------------------------------------- hostile input


@pytest.fixture(scope="module")
def lone_agent():
    agents = Agents(1, peers=False)
    yield agents
    agents.stop()


def _works(agents) -> bool:
    f = remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                       token=agents.token)(lambda: 41 + 1)
    return f() == 42


@pytest.mark.slow
def test_garbage_pickle_is_a_clear_error_naming_the_host_and_the_agent_carries_on(lone_agent):
    garbage = b"RTPU this is not a pickle at all"
    events = run_raw(lone_agent.addresses[0], lone_agent.token,
                      [pb.RunRequest(spec=payload_spec(garbage)), pb.RunRequest(payload_chunk=garbage)])
    end = events[-1].end
    assert end.state == pb.JOB_STATE_FAILED and end.root_cause_host == 0
    exc = end.hosts[0].exception
    assert exc.type_name.endswith("SerializationError")
    assert "not a remote_tpu envelope" in exc.message
    assert _works(lone_agent)


def _rss(agents) -> int:
    return psutil.Process(agents.procs[0].pid).memory_info().rss


@pytest.mark.slow
def test_fuzzing_the_agent_port_leaves_it_up_and_bounded(lone_agent):
    address, token = lone_agent.addresses[0], lone_agent.token
    host, port = address.rsplit(":", 1)
    channel = grpc.insecure_channel(address)
    raw_run = channel.stream_stream("/remote_tpu.v1.Agent/Run",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
    raw_health = channel.unary_unary("/remote_tpu.v1.Agent/Health",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
    valid = pb.RunRequest(spec=payload_spec(b"", accelerator="tpu-v4-16")).SerializeToString()
    _works(lone_agent)
    rss_before = _rss(lone_agent)
    deadline = time.monotonic() + 60
    poked: dict[str, int] = {}

    @settings(max_examples=1500, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(["tcp", "run", "mutated", "health"]),
           data=st.binary(max_size=512), flips=st.lists(st.integers(0, 8 * len(valid) - 1),
                                                         min_size=1, max_size=4))
    def poke(kind, data, flips):
        if time.monotonic() > deadline:
            return
        poked[kind] = poked.get(kind, 0) + 1
        if kind == "tcp":          # raw bytes, no HTTP/2 at all
            with socket.create_connection((host, int(port)), timeout=2) as s:
                s.sendall(data)
            return
        if kind == "health":
            message = data
        elif kind == "run":
            message = data
        else:                      # a valid spec with a few bits flipped
            b = bytearray(valid)
            for bit in flips:
                b[bit // 8] ^= 1 << (bit % 8)
            message = bytes(b)
        md = ((TOKEN_METADATA_KEY, token),)
        try:
            if kind == "health":
                raw_health(message, metadata=md, timeout=5)
            else:
                list(raw_run(iter([message]), metadata=md, timeout=10))
        except grpc.RpcError:
            pass

    poke()
    channel.close()
    assert sum(poked.values()) >= 1000 and len(poked) == 4, poked
    assert _works(lone_agent), "the agent no longer runs jobs after the fuzzing"
    growth = _rss(lone_agent) - rss_before
    assert growth < 64 << 20, f"agent memory grew by {growth >> 20} MiB"


def test_agent_environment_stays_private_unless_passed(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_DB_PASSWORD", "hunter2")
    plain = Agents(1, peers=False)
    passing = Agents(1, peers=False, extra=["--pass-env", "AGENT_DB_PASSWORD"])
    try:
        def visible():
            return {k: os.environ.get(k) for k in
                    ("AGENT_DB_PASSWORD", "REMOTE_TPU_TOKEN", "PATH", "USER_CHOICE")}

        for agents, expected in ((plain, None), (passing, "hunter2")):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                f = remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                                   token=agents.token, env={"USER_CHOICE": "1"})(visible)
            env = f()
            assert env["AGENT_DB_PASSWORD"] == expected
            assert env["REMOTE_TPU_TOKEN"] is None and env["PATH"]
            assert env["USER_CHOICE"] == "1"
    finally:
        plain.stop()
        passing.stop()


# The agent's own secrets, as an operator might set them in its environment.
_AGENT_SECRETS = {"REMOTE_TPU_TOKEN_FILE": "/secret/token",
                  "REMOTE_TPU_TLS_KEY": "/secret/agent-key.pem",
                  "REMOTE_TPU_TLS_CERT": "/secret/agent-cert.pem",
                  "GOOGLE_APPLICATION_CREDENTIALS": "/secret/sa.json"}


def _environ_of(pid: int | str) -> dict[str, str]:
    """The environment a process was started with, as /proc shows it."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return _parse_environ(f.read())


def _parse_environ(raw: bytes) -> dict[str, str]:
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def _own_environ() -> dict[str, str]:
    with open("/proc/self/environ", "rb") as f:
        raw = f.read()
    return {k: v for k, _, v in (i.decode(errors="replace").partition("=")
                                 for i in raw.split(b"\0") if i)}


def _children_with(agents: Agents, word: str) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(agents.procs[0].pid).children(recursive=True):
        try:
            if word in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_process_the_agent_starts_sees_its_secrets(tmp_path, monkeypatch):
    for name, value in _AGENT_SECRETS.items():
        monkeypatch.setenv(name, value)
    seen = tmp_path / "seen"
    seen.mkdir()
    # An interpreter the agent is told of records the environment of each probe of it.
    probed = tmp_path / "python-probed"
    probed.write_text(f"#!/bin/sh\ncat /proc/$$/environ > {seen}/probe.$$\n"
                      f"exec {sys.executable} \"$@\"\n")
    probed.chmod(0o755)
    index = PackageIndex(str(tmp_path))
    index.silent.set()                      # an install that stays running to be looked at
    agents = Agents(1, peers=False, extra=["--python", str(probed)])
    environs: dict[str, dict[str, str]] = {}
    try:
        spares = lambda: [p for p in _children_with(agents, "--spare")  # noqa: E731
                          if is_idle_spare(p)]
        assert wait_until(spares, 60), "no spare worker started"
        environs["spare worker"] = _environ_of(spares()[0].pid)
        run = remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                             token=agents.token, init_jax=False)
        environs["worker"] = run(_own_environ)()
        run(run_command)(["sh", "-c", f"cat /proc/$$/environ > {seen}/exec"])
        environs["exec command"] = _parse_environ((seen / "exec").read_bytes())
        other = payload_spec(b"", accelerator="tpu-v5litepod-4")
        other.client_versions.python = "3.4.10"     # the agent looks for a Python 3.4
        with pytest.raises(grpc.RpcError):
            run_raw(agents.addresses[0], agents.token, [pb.RunRequest(spec=other)])
        probes = sorted(seen.glob("probe.*"))
        assert probes, "the agent did not probe the interpreter it was told of"
        environs["interpreter probe"] = _parse_environ(probes[0].read_bytes())
        remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                       token=agents.token, init_jax=False,
                       requirements=[f"--index-url {index.url}", "rtpu-none"])(int).submit()
        assert wait_until(lambda: index.requests, 60), "the installer never asked the index"
        for p in _children_with(agents, "pip"):
            environs[f"installer {p.cmdline()[:3]}"] = _environ_of(p.pid)
        assert any(k.startswith("installer") for k in environs)
        assert all(env.get("PATH") for env in environs.values())
        leaked = {kind: sorted(k for k, v in env.items() if k in _AGENT_SECRETS or
                               k == "REMOTE_TPU_TOKEN" or agents.token in v)
                  for kind, env in environs.items()}
        assert not {kind: names for kind, names in leaked.items() if names}
    finally:
        for p in _children_with(agents, "pip"):
            p.kill()
        index.close()
        agents.stop()
