"""The security rules that need no agent: token files and TLS options checked
early, refusals logged once per interval and peer, plaintext beyond loopback
warned about (or refused), secret-looking variables warned about. Agents
that enforce the rest: tests/slice/test_security.py, tests/agent/test_auth.py."""

from __future__ import annotations

import warnings

import pytest

import remote_tpu
from certs import pki  # noqa: F401 - a fixture
from conftest import free_port, own_ip
from raw_calls import marking
from remote_tpu._core.auth import new_token
from remote_tpu._core.channels import Credentials, shared_channel


def test_the_directories_made_for_a_token_file_are_owner_only_those_there_kept(tmp_path):
    from conftest import mode, umask
    from remote_tpu._core.auth import write_token_file
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    path = home / ".config" / "remote_tpu" / "token"
    with umask(0):
        write_token_file(str(path), new_token())
    assert mode(home / ".config") == mode(path.parent) == 0o700
    assert mode(home) == 0o755 and mode(path) == 0o600


def test_tls_options_are_checked_early(tmp_path):
    with pytest.raises(remote_tpu.ConfigurationError, match="no such file"):
        remote_tpu.TLS(ca=str(tmp_path / "missing.pem"))
    (tmp_path / "ca.pem").write_text("x")
    with pytest.raises(remote_tpu.ConfigurationError, match="both a certificate and its key"):
        remote_tpu.TLS(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "ca.pem"))


def test_refusals_are_said_once_per_interval_per_peer_and_forgotten_when_quiet(caplog):
    from conftest import wait_until
    from remote_tpu_agent.server.guard import Refusals

    caplog.set_level("WARNING", logger="remote_tpu_agent.server.guard")
    refusals = Refusals(interval=0.5)
    try:
        for i in range(2000):
            peer = "ipv4:10.0.0.7:4242" if i % 2 else "ipv6:%5B::1%5D:4343"
            refusals.note(peer, "/remote_tpu.v1.Agent/Health",
                          "no slice token" if i < 1000 else "a wrong slice token")
        assert len(caplog.records) == 2                   # each peer's first, at once
        assert wait_until(lambda: len(caplog.records) == 4, timeout=5)
        lines = sorted(r.getMessage() for r in caplog.records[2:])
        assert lines == [
            "refused 999 more calls from 10.0.0.7 in the last 0.5 s or less "
            "(a wrong slice token: 500, no slice token: 499)",
            "refused 999 more calls from ::1 in the last 0.5 s or less "
            "(a wrong slice token: 500, no slice token: 499)"]
        refusals.note("ipv4:10.0.0.7:4242", "/remote_tpu.v1.Agent/Run", "no slice token")
        assert len(caplog.records) == 4                   # still refused lately: counted
        assert wait_until(lambda: len(caplog.records) == 5, timeout=5)
        assert "refused 1 more call from 10.0.0.7" in caplog.records[4].getMessage()
        assert wait_until(lambda: not refusals._peers, timeout=5)   # quiet: forgotten
        refusals.note("ipv4:10.0.0.7:4242", "/remote_tpu.v1.Agent/Run", "no slice token")
        assert len(caplog.records) == 6
        assert caplog.records[5].getMessage().startswith(
            "refused /remote_tpu.v1.Agent/Run from 10.0.0.7: no slice token")
    finally:
        refusals.close()


def test_refusals_from_very_many_peers_are_counted_together_beyond_a_bound(caplog):
    from remote_tpu_agent.server import guard as _guard

    caplog.set_level("WARNING", logger="remote_tpu_agent.server.guard")
    refusals = _guard.Refusals(interval=60)
    for i in range(_guard._MAX_PEERS + 500):
        refusals.note(f"ipv4:10.0.{i >> 8}.{i & 255}:1", "/m", "no slice token")
    assert len(caplog.records) == _guard._MAX_PEERS
    refusals.close()
    assert caplog.records[-1].getMessage().startswith(
        "refused 500 more calls from other peers")


def _fresh_remote_address() -> str:
    """A non-loopback address no channel of this process has used. Its channels
    are only created, never connected: no traffic leaves this machine."""
    return f"{own_ip() or '192.0.2.1'}:{free_port()}"


def _plaintext_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "has no TLS" in str(w.message)]


def test_plaintext_channel_beyond_loopback_warns_once_per_address(monkeypatch):
    monkeypatch.delenv("REMOTE_TPU_REQUIRE_TLS", raising=False)
    address, other = _fresh_remote_address(), _fresh_remote_address()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            Credentials(token=new_token()).channel(address).close()
        shared_channel(address, Credentials(token=new_token()))
        Credentials().channel(other).close()
    messages = _plaintext_warnings(caught)
    assert len(messages) == 2, messages
    first = messages[0]
    assert f"the connection to the agent at {address} has no TLS" in first
    assert "slice token" in first and "pickled function and its arguments" in first
    assert "results" in first
    assert "tls=remote_tpu.TLS(ca=...)" in first and "REMOTE_TPU_TLS_CA" in first
    assert "SSH tunnel to 127.0.0.1" in first and "REMOTE_TPU_REQUIRE_TLS=1" in first
    assert other in messages[1]
    assert all(w.category is UserWarning for w in caught)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "[::1]"])
def test_plaintext_on_loopback_neither_warns_nor_is_refused(monkeypatch, host):
    for require in ("0", "1"):
        monkeypatch.setenv("REMOTE_TPU_REQUIRE_TLS", require)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Credentials(token=new_token()).channel(f"{host}:{free_port()}").close()


def test_tls_beyond_loopback_neither_warns_nor_is_refused(monkeypatch, pki):
    monkeypatch.setenv("REMOTE_TPU_REQUIRE_TLS", "1")
    tls = remote_tpu.TLS(ca=str(pki["ca"].path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Credentials(token=new_token(), tls=tls).channel(_fresh_remote_address()).close()


def test_require_tls_refuses_plaintext_beyond_loopback(monkeypatch, tmp_path):
    monkeypatch.setenv("REMOTE_TPU_REQUIRE_TLS", "1")
    address = _fresh_remote_address()
    with pytest.raises(remote_tpu.ConfigurationError) as info:
        Credentials(token=new_token()).channel(address)
    msg = str(info.value)
    assert "refusing to connect without TLS ($REMOTE_TPU_REQUIRE_TLS=1)" in msg
    assert address in msg and "slice token" in msg and "tls=remote_tpu.TLS(ca=...)" in msg
    assert "SSH tunnel to 127.0.0.1" in msg
    f = marking(tmp_path, accelerator="tpu-v5litepod-4", hosts=address, token=new_token())
    with pytest.raises(remote_tpu.ConfigurationError, match="refusing to connect without TLS"):
        f()
    monkeypatch.setenv("REMOTE_TPU_REQUIRE_TLS", "sometimes")
    with pytest.raises(remote_tpu.ConfigurationError,
                       match="REMOTE_TPU_REQUIRE_TLS='sometimes' is not understood"):
        Credentials().channel(address)


def test_secret_looking_env_names_draw_a_warning():
    with pytest.warns(UserWarning, match="env= sends WANDB_API_KEY to every host"):
        remote_tpu.run(accelerator="tpu-v4-8", hosts="local", env={"WANDB_API_KEY": "k"})
