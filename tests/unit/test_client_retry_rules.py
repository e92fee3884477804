"""The client's retries where no agent is involved: an address that never
answered gives up in about a second, one that answered before is retried for
a bounded time, the memory of answers is owner-only, a typo of 'local' is
named, and Submit's upload deadline grows with the payload. With real agents
coming and going: tests/slice/test_client_retry.py."""

from __future__ import annotations

import time

import pytest

import remote_tpu
from conftest import free_port
from remote_tpu._client import upload_deadline
from remote_tpu._core.auth import new_token

ACCELERATOR = "tpu-v5litepod-4"      # one host
NOTICE = "remote_tpu: no agent answered at"
GiB = 1 << 30


def test_the_memory_of_agents_that_answered_is_kept_in_owner_only_directories(
        tmp_path, monkeypatch):
    """$XDG_STATE_HOME/remote_tpu/answered: each directory made on the way is
    0700 (as the XDG spec asks); one that was there keeps its mode."""
    from conftest import mode, umask
    from remote_tpu import _answered
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    monkeypatch.setattr(_answered, "_known", None)
    with umask(0):
        _answered.note("127.0.0.1:8475")
    for made in (home / ".local", home / ".local" / "state",
                 home / ".local" / "state" / "remote_tpu"):
        assert mode(made) == 0o700, made
    assert mode(home) == 0o755
    assert mode(home / ".local" / "state" / "remote_tpu" / "answered") == 0o600


def _call_nothing_at(port: int) -> tuple[float, str]:
    """Call an address where nothing listens: (seconds until it gave up, error)."""
    @remote_tpu.run(accelerator=ACCELERATOR, hosts=f"127.0.0.1:{port}", token=new_token())
    def f():
        return 1

    start = time.monotonic()
    with pytest.raises(remote_tpu.AgentUnavailableError) as info:
        f()
    return time.monotonic() - start, str(info.value)


@pytest.mark.slow
def test_an_address_that_never_answered_fails_in_about_a_second(capsys):
    port = free_port()                   # nothing listens there, nor ever did
    elapsed, error = _call_nothing_at(port)
    assert elapsed < 3, f"gave up after {elapsed:.1f} s"
    assert f"No agent has ever answered this machine at 127.0.0.1:{port}" in error
    assert NOTICE not in capsys.readouterr().err


def test_a_typo_of_local_is_named():
    with pytest.raises(remote_tpu.AgentUnavailableError, match="did you mean hosts='local'"):
        remote_tpu.run(accelerator=ACCELERATOR, hosts="locla", token=new_token())(lambda: 42)()


@pytest.mark.slow
def test_no_agent_at_all_fails_after_bounded_retries(capsys):
    port = free_port()                   # nothing listens there now; one answered before
    from remote_tpu import _answered
    _answered.note(f"127.0.0.1:{port}")
    elapsed, error = _call_nothing_at(port)
    assert f"no remote_tpu agent answered at 127.0.0.1:{port} (UNAVAILABLE" in error
    # 15 s of retries from the first attempt; the last wait is at most 2 s.
    assert 14 <= elapsed <= 25, f"gave up after {elapsed:.1f} s"
    assert capsys.readouterr().err.count(NOTICE) == 1


def test_upload_deadline_grows_with_the_payload():
    assert upload_deadline(0) == 600
    assert upload_deadline(1 << 20) < 602        # small payloads: the fixed 600 s
    assert upload_deadline(GiB) > upload_deadline(GiB // 2) > upload_deadline(0)
    # the advertised limit (16 GiB) fits at 1 MB/s, not only at 28 MB/s
    assert upload_deadline(16 * GiB) >= 16 * GiB / 1_000_000
    assert 16 * GiB / upload_deadline(16 * GiB) <= 1_000_000


def test_ctrl_c_before_the_call_is_sent_is_the_keyboard_interrupt(monkeypatch, capsys):
    """Ctrl-C while the arguments are still being prepared (their buffers
    uploaded): nothing was sent, so nothing is said of the slice."""
    from remote_tpu import _client

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(_client, "_with_blobs", interrupted)
    f = remote_tpu.run(accelerator="tpu-v4-8", hosts=f"127.0.0.1:{free_port()}",
                       token=new_token(), keep_warm=30)(lambda: 1)
    with pytest.raises(KeyboardInterrupt):
        f()
    assert "remote_tpu: job" not in capsys.readouterr().err
