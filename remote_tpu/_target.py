"""Where a call goes: every form of ``hosts`` -> one slice endpoint.

``hosts`` (``"local"``, an address, a list, ``"tpu://NAME?zone=..."`` or
``$REMOTE_TPU_HOSTS``) and the caller's token and TLS settings become a
``Target``: the gateway to call, the host list for the job spec, the
credentials. ``Target.call`` is the one way calls reach the gateway: it follows
an agent's redirect to worker 0 of its slice, and, for calls the agent has not
answered yet, retries refused connections (an agent restarting) for 15 s, and
for about a second at an address that never answered this machine (_answered).
Call, submit, attach, jobs, doctor and the command line all go through here.
"""

from __future__ import annotations

import difflib
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import tenacity

from . import _answered as answered
from ._core.addresses import Hosts, parse_hosts
from ._core.auth import TLS
from ._core.channels import (Credentials, Redirect, error_from_rpc, forget_if_unavailable,
                             stub, tls_failure)
from ._core.exceptions import AgentUnavailableError, ConfigurationError
from ._core.proto import remote_tpu_pb2_grpc as pb_grpc
from ._core.tls_probe import turned_away
from ._core.topology import Topology

T = TypeVar("T")
RETRY_SECONDS = 15.0                        # see _retrying
NEW_AGENT_SECONDS = 1.0                     # an address that never answered (_answered)
_LOCAL_LIFETIME = "a local slice lives only as long as the process that started it"
_NOT_LOCAL = ("hosts='local' names no slice that can be reached from here: only a call or "
              f"submit() starts a local slice, and {_LOCAL_LIFETIME}. Start one that other "
              "processes can reach with `remote-tpu local --accelerator NAME` and pass the "
              "addresses it prints as hosts= (in the process that submitted a job, its "
              "JobHandle reaches it)")


class Target:
    """One slice, as a caller reaches it.

    gateway: the agent to call (worker 0 once a redirect was followed).
    hosts: every host's address (first = gateway) when the caller listed them;
        empty when the gateway knows its peers itself.
    """

    def __init__(self, gateway: str, hosts: Sequence[str], credentials: Credentials, *,
                 local: bool = False) -> None:
        self.gateway = gateway
        self.hosts = tuple(hosts)
        self.credentials = credentials
        self.local = local
        self._tls_asked = False          # see _refused_tls

    def __repr__(self) -> str:
        return f"<Target {self.gateway}{' (local slice)' if self.local else ''}>"

    def stub(self) -> pb_grpc.AgentStub:
        return stub(self.gateway, self.credentials)

    def call(self, method: Callable[[Target], T], *, retry: bool = False) -> T:
        """``method(self)``, its gRPC failures turned into our errors. An agent
        that names another as the slice's gateway is followed, once; with
        ``retry``, refused connections are retried (see ``_retrying``)."""
        for redirected in (False, True):
            self._tls_asked = False            # (asked of each gateway once)
            try:
                if retry:
                    budget = RETRY_SECONDS if self.local or answered.before(self.gateway) \
                        else NEW_AGENT_SECONDS
                    done = _retrying(self.gateway, lambda: self._attempt(method), budget)
                else:
                    done = self._attempt(method)
                answered.note(self.gateway)
                return done
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, self.gateway)
                if isinstance(err, Redirect) and not redirected:
                    self.gateway = err.address
                    continue
                raise self.explain(err) from None
        raise AssertionError("unreachable")

    def _attempt(self, method: Callable[[Target], T]) -> T:
        try:
            return method(self)
        except grpc.RpcError as exc:
            forget_if_unavailable(exc, self.gateway, self.credentials)
            self._refused_tls(exc)
            raise

    def _refused_tls(self, exc: grpc.RpcError) -> None:
        """A connection closed at once may be the agent turning this client's
        TLS settings away (none, to an agent with TLS; no certificate or the
        wrong one, to one with mutual TLS), which gRPC cannot tell from an agent
        restarting: asked once (``tls_probe``), and raised, not retried for 15 s
        and blamed on an agent that did answer."""
        if self._tls_asked or not _unavailable(exc):
            return
        self._tls_asked = True
        err = turned_away(self.gateway, self.credentials.tls, exc.details() or "")
        if err is not None:
            raise err from None

    def explain(self, err: Exception) -> Exception:
        """``err``, with what a local slice's caller, or one whose address
        never answered, should know added."""
        if not isinstance(err, AgentUnavailableError):
            return err
        if self.local:
            return AgentUnavailableError(f"{err} ({_LOCAL_LIFETIME})")
        host = self.gateway.rsplit(":", 1)[0]
        if "resolv" in str(err) and difflib.get_close_matches(host.lower(), ["local"], 1, 0.6):
            return AgentUnavailableError(f"{host!r} is not a host name that resolves: did you "
                                         f"mean hosts='local' (a simulated slice)? {err}")
        if not answered.before(self.gateway):
            return AgentUnavailableError(
                f"{err} No agent has ever answered this machine at {self.gateway}, so it was "
                f"asked for {NEW_AGENT_SECONDS:g} s only (an agent that answered before is "
                f"waited for {RETRY_SECONDS:g} s, as while it restarts).")
        return err


def resolve_target(hosts: str | Sequence[str] | Hosts | None, *,
                   topology: Topology | None = None, token: str | None = None,
                   tls: TLS | None = None) -> Target:
    """The slice behind ``hosts``. With ``topology`` (a call or submission), a
    local slice of that shape is started on first use, and the slice's own
    host count and accelerator are checked against it; without (attach, jobs,
    doctor), ``hosts`` must name agents that already run."""
    parsed = hosts if isinstance(hosts, Hosts) else parse_hosts(hosts)
    if parsed.local:
        if topology is None:
            raise ConfigurationError(_NOT_LOCAL)
        from ._local_slice import get_local_slice
        local = get_local_slice(topology)
        return Target(local.addresses[0], local.addresses, local.credentials, local=True)
    addresses = list(parsed.entries)
    if parsed.tpu_url:
        from ._cloud import resolve as resolve_tpu
        addresses, accelerator = resolve_tpu(parsed.tpu_url)
        if topology is not None:
            if accelerator:
                topology.check_same(accelerator, parsed.tpu_url)
            topology.check_host_count(addresses, parsed.tpu_url,
                                      "Use the accelerator the slice really is.")
    elif topology is not None and len(addresses) > 1:
        topology.check_host_count(addresses, parsed.source)
    credentials = Credentials.for_client(token, tls)
    return Target(addresses[0], addresses if len(addresses) > 1 else (), credentials)


def running_targets(hosts: str | Sequence[str] | Hosts | None, *,
                    topology: Topology | None = None, token: str | None = None,
                    tls: TLS | None = None) -> list[Target]:
    """The slices behind ``hosts`` that run now: for ``"local"``, this
    process's local slices (of ``topology``'s shape, when given), none started;
    otherwise the one slice ``resolve_target`` finds."""
    parsed = hosts if isinstance(hosts, Hosts) else parse_hosts(hosts)
    if not parsed.local:
        return [resolve_target(parsed, token=token, tls=tls)]
    from ._local_slice import running_local_slices
    return [Target(s.addresses[0], s.addresses, s.credentials, local=True)
            for s in running_local_slices(topology)]


def _retrying(gateway: str, attempt: Callable[[], T], budget: float = RETRY_SECONDS) -> T:
    """The retries of a call that the agent has not answered yet (Submit, and Run
    before its first event), safe because the agent takes a job id only once.

    Only UNAVAILABLE is retried (nothing answered: the agent is restarting, or
    the connection dropped before any reply), never another status. The budget
    counts from the call's first attempt, so a call that failed after running
    for long is not sent again. The channel backs off its own reconnects
    (``channels.channel_options``: from 0.25 s up to 2 s), and an attempt
    reaches an agent only after the channel's next try, so an agent back within
    about 13 s is reached. No agent at all is reported after about 16 s."""
    # The first attempt goes alone (nearly every call: answered at once), with
    # none of the retry machinery, which cost a warm call 0.1 ms; the retries
    # after it are what one Retrying from the start would have made.
    start = time.monotonic()
    try:
        return attempt()
    except Exception as exc:  # noqa: BLE001 - only what _unavailable says is retried
        if not _unavailable(exc) or time.monotonic() - start >= budget:
            raise
    if budget >= RETRY_SECONDS:
        _retry_notice(gateway)
    time.sleep(_FIRST_WAIT)
    return tenacity.Retrying(
        stop=lambda state: time.monotonic() - start >= budget, reraise=True,
        wait=tenacity.wait_exponential(multiplier=2 * _FIRST_WAIT, max=2),
        retry=tenacity.retry_if_exception(_unavailable))(attempt)


_FIRST_WAIT = 0.25     # then 0.5, 1, 2, 2, ... s


def _unavailable(exc: BaseException) -> bool:
    """No connection could be made, so nothing reached the agent: it is not
    listening (yet), as while it restarts, or an SSH tunnel to it accepted and
    closed. Not a TLS failure, which asking again would not mend."""
    if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = exc.details() or ""
    return "failed to connect to all addresses" in details and not tls_failure(details)


def _retry_notice(gateway: str) -> None:
    """Once per call, not once per attempt."""
    print(f"remote_tpu: no agent answered at {gateway}; retrying for up to "
          f"{RETRY_SECONDS:.0f} s (if it is not restarting, check that "
          "`remote-tpu-agent` runs there)", file=sys.stderr, flush=True)
