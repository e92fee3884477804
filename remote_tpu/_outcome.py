"""A job's events -> its output shown, then the value, or the exception the caller sees."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import grpc

from ._core import digests
from ._core.channels import error_from_rpc
from ._core.exceptions import (AgentUnavailableError, JobFailedError, JobTimeoutError,
                               RemoteError, RemoteTraceback, SerializationError)
from ._core.proto import remote_tpu_pb2 as pb
from ._core.serialization import loads
from ._core.remote_exceptions import rebuild_exception
from ._core.states import HOST_STATE_WORDS
from ._render import OutputRenderer

def describe_hosts(reports: Sequence[pb.HostReport]) -> str:
    lines = []
    for r in reports:
        words = HOST_STATE_WORDS.get(r.state, "unknown")
        detail = f" ({r.detail})" if r.detail else ""
        lines.append(f"  host {r.host}: {words}{detail}")
    return "\n".join(lines)


def _last_lines(report: pb.HostReport) -> str:
    if not report.last_lines:
        return "  (no output)"
    return "\n".join(f"  | {line}" for line in report.last_lines)


def raise_for_end(end: pb.JobEnd, *, accelerator: str, job_id: str) -> None:
    """Return if the job succeeded, else raise what the caller should see."""
    if end.state == pb.JOB_STATE_SUCCEEDED:
        return
    hosts = describe_hosts(end.hosts)
    where = f"{accelerator}, job {job_id}"
    if end.state == pb.JOB_STATE_TIMED_OUT:
        stacks = "".join(f"\n===== host {r.host} =====\n{r.stacks.rstrip()}\n"
                         for r in end.hosts if r.stacks)
        raise JobTimeoutError(f"job {job_id} on {accelerator} {end.detail}; every host was "
                              f"stopped. Final state of each host:\n{hosts}"
                              + (f"\nWhere each host was at the timeout:{stacks}"
                                 if stacks else ""), hosts=end.hosts)
    if end.state == pb.JOB_STATE_PREEMPTED:
        raise JobFailedError(f"job {job_id} on {accelerator} ended: {end.detail}. Final state "
                             f"of each host:\n{hosts}", host=end.root_cause_host,
                             hosts=end.hosts)
    if end.state == pb.JOB_STATE_LOST:
        raise JobFailedError(f"job {job_id} on {accelerator} was lost: {end.detail}",
                             hosts=end.hosts)
    if end.state == pb.JOB_STATE_CANCELLED:
        raise JobFailedError(f"job {job_id} on {accelerator} was cancelled: "
                             f"{end.detail or 'no reason given'}. Final state of each "
                             f"host:\n{hosts}", hosts=end.hosts)
    if end.root_cause_host < 0 or end.root_cause_host >= len(end.hosts):
        detail = end.detail or "no host reported a cause"
        raise JobFailedError(f"job {job_id} on {accelerator} failed: {detail}. Final state "
                             f"of each host:\n{hosts}", hosts=end.hosts)
    h = end.root_cause_host
    root = end.hosts[h]
    n = len(end.hosts)
    if root.state == pb.HOST_STATE_FAILED and root.exception.type_name:
        info = root.exception
        cause = RemoteTraceback(f"\nTraceback on host {h} of {n} ({where}):\n"
                                f"{info.traceback.rstrip()}")
        exc = rebuild_exception(info.pickled)
        if isinstance(exc, Exception):
            try:
                exc.add_note(f"raised on host {h} of {n} ({where}). Final state of each "
                             f"host:\n{hosts}" + (f"\n{end.detail}" if end.detail else ""))
                exc.remote_host = h  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            raise exc from cause
        raise RemoteError(
            f"host {h} of {n} raised {info.type_name}: {info.message} (the exception "
            f"could not be rebuilt here; its traceback is below). Final state of each "
            f"host:\n{hosts}",
            type_name=info.type_name, remote_traceback=info.traceback, host=h) from cause
    also = f" The agent adds: {end.detail}." if end.detail else ""
    raise JobFailedError(
        f"host {h} of {n} ({where}) {root.detail or HOST_STATE_WORDS.get(root.state, 'failed')}."
        f"{also} Final state of each host:\n{hosts}\nLast output of host {h}:\n"
        f"{_last_lines(root)}", host=h, hosts=end.hosts)


def outcome(stream, renderer: OutputRenderer, *, gateway: str, job_id: str,
            accelerator: str) -> Any:
    """Consume a Run or Result stream: show output, then return the value or
    raise what the caller should see."""
    chunks: list[bytes] = []
    end: pb.JobEnd | None = None
    try:
        for event in stream:
            kind = event.WhichOneof("kind")
            if kind == "output":
                renderer.write(event.host, event.output.stream, event.output.data)
            elif kind == "result_chunk":
                chunks.append(event.result_chunk)
            elif kind == "end":
                end = event.end
            elif kind == "queued":
                q = event.queued
                ahead = (f"the warm workers of {q.queued_behind} (another caller's "
                         "keep_warm; they stay until its process ends, they are idle for "
                         "its keep_warm time, or `remote-tpu release --hosts "
                         f"{gateway}` ends them)"
                         if q.queued_behind.startswith("warm-") else f"job {q.queued_behind}")
                print(f"remote_tpu: job {job_id} is queued behind {ahead} "
                      f"(position {q.queue_position}) on {accelerator}", file=sys.stderr,
                      flush=True)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, gateway) from None
    except BaseException:
        stream.cancel()          # Ctrl-C: the gateway stops every host
        raise
    finally:
        renderer.close()
    if end is None:
        raise AgentUnavailableError(f"the agent at {gateway} ended job {job_id} without a "
                                    "final report; see its log")
    for notice in end.notices:
        print(f"remote_tpu: {notice}", file=sys.stderr, flush=True)
    raise_for_end(end, accelerator=accelerator, job_id=job_id)
    data = bytearray(sum(len(c) for c in chunks))
    digest = digests.new()
    pos = 0
    for c in chunks:
        data[pos:pos + len(c)] = c
        digest.update(c)
        pos += len(c)
    chunks.clear()
    if digest.digest() != end.result_digest:
        raise SerializationError(f"the return value of job {job_id} arrived corrupted (its "
                                 f"{digests.NAME} digest does not match the gateway's); nothing was "
                                 "unpickled. Call again.")
    return loads(data, what="return value")
