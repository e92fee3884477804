"""Where agents are: ``ip[:port]`` addresses, and every form of ``hosts``.

``hosts`` is ``"local"`` (a simulated slice on this machine), one agent address
(the gateway, or any agent of the slice: it redirects to worker 0), a list of
every host's address (first = gateway; also as one comma-separated string), or
``"tpu://NAME?zone=..."`` (resolved through the Cloud TPU API when a call is
made); ``None`` reads ``$REMOTE_TPU_HOSTS`` (comma separated), and defaults to
``"local"``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import urllib.parse
from collections.abc import Sequence

from .exceptions import ConfigurationError

DEFAULT_AGENT_PORT = 8475
LOCAL = "local"
HOSTS_ENV = "REMOTE_TPU_HOSTS"
TPU_SCHEME = "tpu://"
_ADDRESS = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+))(?::(?P<port>\d+))?$")


def join_host_port(host: str, port: int) -> str:
    """``("::1", 80)`` -> ``"[::1]:80"``; IPv4 addresses and names stay as they are."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of(address: str) -> str:
    """``"10.0.0.2:8475"`` -> ``"10.0.0.2"``, ``"[::1]:8475"`` -> ``"::1"``."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def free_port() -> int:
    """A TCP port free on every address of this machine now: the JAX
    coordinator's, on a gateway. JAX binds it on all of them (``[::]``), so a
    port free on the gateway's own address alone may be taken on another (an
    agent or a test on 127.0.0.1, say), and then the coordinator cannot start."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # IPv4 too
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:                  # no IPv6 here
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", 0))
            return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def normalize_address(address: str) -> str:
    """``"10.0.0.2"`` -> ``"10.0.0.2:8475"``; raises ConfigurationError when malformed."""
    if not isinstance(address, str):
        raise ConfigurationError(
            f"a host address must be a string 'ip[:port]', got {type(address).__name__} "
            f"{address!r}")
    m = _ADDRESS.match(address.strip())
    if not m:
        raise ConfigurationError(
            f"host address {address!r} is not of the form 'ip[:port]' (for example "
            f"'10.0.0.2', '10.0.0.2:{DEFAULT_AGENT_PORT}' or '[::1]:{DEFAULT_AGENT_PORT}')")
    port = int(m.group("port") or DEFAULT_AGENT_PORT)
    if not 0 < port < 65536:
        raise ConfigurationError(f"host address {address!r}: port {port} is not in 1-65535")
    return join_host_port(m.group("v6") or m.group("host"), port)


@dataclasses.dataclass(frozen=True)
class TpuRef:
    """``tpu://NAME?zone=ZONE[&project=P][&port=N][&external=1]``, parsed."""

    name: str
    zone: str
    project: str
    port: int
    external: bool

    @classmethod
    def parse(cls, url: str) -> TpuRef:
        parsed = urllib.parse.urlparse(url)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        name = parsed.netloc
        unknown = set(query) - {"zone", "project", "port", "external"}
        if parsed.scheme != "tpu" or not name or parsed.path not in ("", "/") or unknown:
            raise ConfigurationError(
                f"{url!r} is not a TPU reference of the form "
                "'tpu://NAME?zone=ZONE[&project=PROJECT][&port=PORT][&external=1]'"
                + (f" (unknown option {sorted(unknown)[0]!r})" if unknown else ""))
        if not query.get("zone"):
            raise ConfigurationError(f"{url!r} needs ?zone=..., the TPU's zone "
                                     "(e.g. us-central2-b)")
        try:
            port = int(query.get("port", DEFAULT_AGENT_PORT))
        except ValueError:
            raise ConfigurationError(f"{url!r}: port {query['port']!r} is not a number") \
                from None
        return cls(name=name, zone=query["zone"], project=query.get("project", ""),
                   port=port, external=query.get("external", "") in ("1", "true", "yes"))


@dataclasses.dataclass(frozen=True)
class Hosts:
    """``hosts`` as given, checked: ``("local",)``, ``("tpu://...",)`` or agent
    addresses (first = gateway); ``source`` names where it came from, for errors."""

    entries: tuple[str, ...]
    source: str = "hosts="

    @property
    def local(self) -> bool:
        return self.entries == (LOCAL,)

    @property
    def tpu_url(self) -> str:
        """The ``tpu://`` reference, or "" when the hosts are addresses."""
        first = self.entries[0]
        return first if first.startswith(TPU_SCHEME) else ""


def parse_hosts(hosts: str | Sequence[str] | None) -> Hosts:
    """Every form of ``hosts`` (see the module's docstring), checked for syntax.
    Whether the count fits the accelerator is ``Topology.check_host_count``'s."""
    source = "hosts="
    if hosts is None:
        hosts = os.environ.get(HOSTS_ENV) or LOCAL
        source = HOSTS_ENV
        if ";" in hosts:        # several slices (num_slices=): their gateway is slice 0's
            hosts = hosts.split(";")[0]
            source = f"{HOSTS_ENV} (slice 0 of its ';'-separated slices)"
    if isinstance(hosts, str) and "," in hosts:          # as `remote-tpu local` prints them
        hosts = [h for h in hosts.split(",") if h.strip()]
    if isinstance(hosts, list | tuple) and len(hosts) == 1 and isinstance(hosts[0], str):
        hosts = hosts[0]                                # (one entry: as if given alone)
    if isinstance(hosts, str):
        hosts = hosts.strip()
        if hosts.lower() == LOCAL:
            return Hosts((LOCAL,), source)
        if hosts.startswith(TPU_SCHEME):
            TpuRef.parse(hosts)          # resolved when a call is made, checked now
            return Hosts((hosts,), source)
        return Hosts((normalize_address(hosts),), source)
    if not isinstance(hosts, Sequence) or isinstance(hosts, bytes | bytearray) or not hosts:
        raise ConfigurationError(
            f"{source} must be 'local', an address 'ip[:port]', 'tpu://NAME?zone=...' or "
            f"a non-empty list of addresses (first = gateway); got {hosts!r}")
    odd = [h for h in hosts if isinstance(h, str) and
           (h.strip().lower() == LOCAL or h.startswith(TPU_SCHEME))]
    if odd:
        raise ConfigurationError(
            f"{source} lists {odd[0]!r} among other hosts: give it alone, or list agent "
            "addresses only")
    addresses = tuple(normalize_address(h) for h in hosts)
    if len(set(addresses)) != len(addresses):
        raise ConfigurationError(f"{source} lists an address twice: {', '.join(addresses)}")
    return Hosts(addresses, source)
