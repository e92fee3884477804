"""remote-tpu setup's checks of what it is given, before any host is touched,
and what it says when hosts fail (the hosts themselves: tests/slice/test_setup.py)."""

from __future__ import annotations

import pytest

from remote_tpu import _setup
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._setup import HostResult, Plan, SshHost

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("text, parsed", [
    ("me@10.0.0.2", ("me", "10.0.0.2", 22)),
    ("10.0.0.2:2222", ("", "10.0.0.2", 2222)),
    ("t1v-n-1-w-0", ("", "t1v-n-1-w-0", 22)),
    ("root@[fd00::5]:2200", ("root", "fd00::5", 2200)),
    ("fd00::5", ("", "fd00::5", 22)),
])
def test_ssh_addresses(text, parsed):
    host = SshHost.parse(3, text)
    assert (host.user, host.host, host.ssh_port) == parsed and host.index == 3


@pytest.mark.parametrize("text, said", [
    ("", "is not an SSH address"),
    ("me@", "is not an SSH address"),
    ("a b", "is not an SSH address"),
    ("-oProxyCommand=touch /tmp/x", "is not an SSH address"),     # never an ssh option
    ("-oProxyCommand=x@host", "is not an SSH address"),
    ("host:0", "SSH port '0' is not a port"),
    ("host:65536", "SSH port '65536' is not a port"),
    ("host:ssh", "SSH port 'ssh' is not a port"),
    ("[fd00::5]junk", "is not an SSH address"),
    ("[fd00::5", "is not an SSH address"),
    ("@host", "is not an SSH address"),
])
def test_bad_ssh_addresses_are_refused_with_the_form_to_use(text, said):
    with pytest.raises(ConfigurationError, match=said):
        SshHost.parse(0, text)


def test_peers_get_addresses_the_hosts_can_reach():
    hosts = (SshHost(0, "", "localhost", 2222), SshHost(1, "", "localhost", 2223))
    with pytest.raises(ConfigurationError,
                       match=r"loopback address \(127.0.0.1\).*\(a port forward\?\)"):
        _setup.peer_ips(hosts)
    with pytest.raises(ConfigurationError,
                       match=r"does not resolve here.*\(an ssh_config alias\?\)"):
        _setup.peer_ips((SshHost(0, "", "no-such-host.invalid", 22),))
    one = (SshHost(0, "", "127.0.0.1", 22),)
    assert _setup.peer_ips(one) == ["127.0.0.1"]          # one host: loopback is fine


def test_a_bad_user_never_becomes_an_ssh_option():
    with pytest.raises(ConfigurationError, match="is not a user name"):
        _setup.hosts_of(["10.0.0.2"], user="-oProxyCommand=touch /tmp/x")
    plan = Plan((SshHost(0, "me", "10.0.0.2", 22),))
    assert plan.ssh(plan.hosts[0], "true")[-3:] == ["--", "me@10.0.0.2", "true"]


def test_hosts_are_named_once_in_worker_order_and_tpu_refs_alone():
    hosts, from_api = _setup.hosts_of(["10.0.0.2", "me@10.0.0.3"], user="ops")
    assert [h.target for h in hosts] == ["ops@10.0.0.2", "me@10.0.0.3"] and not from_api
    with pytest.raises(ConfigurationError, match="named twice"):
        _setup.hosts_of(["10.0.0.2", "root@10.0.0.2"])
    with pytest.raises(ConfigurationError, match="not both"):
        _setup.hosts_of(["tpu://x?zone=z", "10.0.0.2"])
    with pytest.raises(ConfigurationError, match="which hosts"):
        _setup.hosts_of([])


@pytest.mark.parametrize("agent_args, said", [
    ("--port 9000", "--port is \\(or abbreviates\\) --port, which setup gives"),
    ("--peers=a,b", "--peers is \\(or abbreviates\\) --peers"),
    ("--token-file /x", "abbreviates\\) --token-file"),
    ("--por 9000", "--por is \\(or abbreviates\\) --port"),     # argparse would take it
    ("--tok /x", "abbreviates\\) --token-file"),
    ("--ho 1.2.3.4", "abbreviates\\) --host"),
    ("--us root", "abbreviates\\) --user"),                  # install-service's own
    ("--dry-run", "abbreviates\\) --dry-run"),
    ('--log-level "INFO', "--agent-args"),
])
def test_agent_flags_setup_owns_are_refused(agent_args, said):
    with pytest.raises(ConfigurationError, match=said):
        _setup.main(["10.0.0.2"], agent_args=agent_args)


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_a_bad_agent_port_is_refused(port):
    with pytest.raises(ConfigurationError, match=f"--agent-port {port}"):
        _setup.main(["10.0.0.2"], port=port)


def test_a_missing_key_is_named_before_any_host_is_touched(tmp_path):
    with pytest.raises(ConfigurationError, match="no SSH key at"):
        _setup.main(["10.0.0.2"], identity_file=str(tmp_path / "absent"))


def test_each_agent_gets_its_place_and_tls_replaces_insecure():
    hosts = (SshHost(0, "", "10.0.0.2", 22), SshHost(1, "", "10.0.0.3", 22))
    plan = Plan(hosts, port=9000)
    assert plan.flags_for(hosts[1]) == ["--host", "0.0.0.0", "--insecure", "--worker-id", "1",
                                        "--peers", "10.0.0.2:9000,10.0.0.3:9000"]
    tls = Plan(hosts, agent_flags=("--tls-cert", "c", "--tls-key", "k"),
               explicit_places=False)
    assert tls.flags_for(hosts[0]) == ["--host", "0.0.0.0", "--tls-cert", "c", "--tls-key", "k"]
    assert tls.ssh(hosts[0], "true")[-2:] == ["10.0.0.2", "true"]


def test_the_wheel_digest_is_of_the_modules_alone(tmp_path):
    from remote_tpu._wheel import client_wheel
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (a, da), (b, db) = client_wheel(str(tmp_path / "a")), client_wheel(str(tmp_path / "b"))
    assert da == db and open(a, "rb").read() == open(b, "rb").read()


def test_the_report_names_each_failing_host_with_its_last_lines_and_who_is_ready():
    ok = HostResult(SshHost(0, "", "10.0.0.2", 22), ok=True, summary="started")
    bad = HostResult(SshHost(1, "", "10.0.0.3", 22), summary="pip could not install")
    bad.tail.extend(f"line {i}" for i in range(50))
    text = _setup.report([ok, bad])
    assert text.startswith("1 of 2 host(s) failed:")
    assert "host 1 (10.0.0.3): pip could not install" in text
    assert "line 49" in text and "line 29" not in text       # the last 20 lines only
    assert "Host 0 is ready, its agent running." in text and "run setup again" in text
    assert _setup.report([ok]) == ""


@pytest.mark.parametrize("extra, said", [
    (["--idle-delete", "0"], ""),                       # 0: off, nothing to check
    (["--idle-delete", "-1"], "--idle-delete -1: give minutes above 0, up to 10080"),
    (["--idle-delete", "20000"], "--idle-delete 20000: give minutes above 0"),
    (["--idle-delete", "30", "--no-setup"], "carried out by the slice's agents"),
])
def test_up_checks_idle_delete_before_asking_for_anything(extra, said, capsys, monkeypatch):
    from remote_tpu import _cli, _tpu_api

    asked = []
    monkeypatch.setattr(_tpu_api, "up", lambda *a, **k: asked.append(k) or [])
    code = _cli.main(["up", "x", "--accelerator", "tpu-v4-8", "--zone", "z", "--project", "p",
                      *extra])
    if said:
        assert code == 1 and said in capsys.readouterr().err and not asked
    else:
        assert code == 0 and asked[0]["cloud_scope"] is False
