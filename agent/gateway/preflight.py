"""Before a job starts anywhere: every peer agent must answer, accept the
gateway's credentials, speak its protocol and hold the job's buffers, and
this host's TPU must be free. Else nothing starts on any host."""

from __future__ import annotations

import time
from collections.abc import Sequence

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu._core.versions import local_versions, skew_table, slice_skew

from remote_tpu_agent.gateway.peer_process import RemoteHost, preflight_all
from remote_tpu_agent.host.tpu import TpuBusy, TpuGuard


def preflight(remotes: Sequence[RemoteHost], reports: list[pb.HostReport],
              tpu: TpuGuard | None, silent: set[str], blob_problems: dict[str, str]
              ) -> tuple[list[pb.HostReport], bool, str]:
    """The hosts that refuse the job (their ``reports`` set, the others' saying
    why they did not start), whether asking again cannot help, and where the
    hosts' versions differ, every host's versions (else ""). ``silent``: peer
    agents that did not even answer; ``blob_problems``: why a peer agent lacks
    the job's buffers."""
    # One check per peer agent, whatever its processes; none of a silent one.
    first = {r.address: r for r in remotes if r.address not in silent}
    by_agent = dict(zip(first, preflight_all(list(first.values()))))
    permanent = any(permanent for _, permanent in by_agent.values())
    problems = [by_agent.get(remote.address, ("", False))[0] or
                blob_problems.get(remote.address, "") for remote in remotes]
    refused = []
    if tpu is not None:
        try:
            tpu.prepare()
        except TpuBusy as exc:
            reports[0] = pb.HostReport(host=0, state=pb.HOST_STATE_LOST,
                                       finished_at=time.time(), detail=f"cannot start: {exc}")
            refused.append(reports[0])
    for remote, problem in zip(remotes, problems):
        if problem:
            reports[remote.host] = pb.HostReport(host=remote.host, state=pb.HOST_STATE_LOST,
                                                 detail=problem, finished_at=time.time())
            refused.append(reports[remote.host])
    for report in reports:
        if report.state == pb.HOST_STATE_PENDING and refused:
            report.detail = "not started: another host refused the job"
    return refused, permanent, _versions(list(first.values()))


def _versions(remotes: Sequence[RemoteHost]) -> str:
    """Every host's versions where they differ (one line per agent)."""
    hosts = {"host 0 (the gateway)": local_versions()}
    hosts.update({f"host {r.host} ({r.address})": r.versions for r in remotes
                  if r.versions is not None})
    if not slice_skew(hosts):
        return ""
    return ("the hosts run different versions (every host of a slice must run the same "
            "remote_tpu, Python, jax, jaxlib and libtpu releases: install the same ones on "
            "each; `remote-tpu doctor` shows them):\n" + skew_table(hosts))
