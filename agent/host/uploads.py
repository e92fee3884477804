"""Receiving a job's payload: kept in memory when small, else streamed to a
private file; its size and SHA-256 checked against the spec, a full disk
refused with what to do."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import grpc

from remote_tpu._core import digests
from remote_tpu._core.channels import ERROR_KIND_KEY
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.jobs.requests import Refused, abort
from remote_tpu_agent.worker.frames import INLINE_BYTES


class Uploads:
    """Payloads arrive in ``state_dir/incoming`` until their job is created;
    what an earlier agent left there died with it and is removed."""

    def __init__(self, state_dir: str, endpoint: Callable[[], str],
                 full_message: Callable[[], str]) -> None:
        self.incoming = os.path.join(state_dir, "incoming")
        shutil.rmtree(self.incoming, ignore_errors=True)
        os.makedirs(self.incoming, mode=0o700, exist_ok=True)
        self._endpoint = endpoint
        self._full_message = full_message

    def new_file(self, job_id: str) -> str:
        fd, path = tempfile.mkstemp(dir=self.incoming, prefix=job_id)
        os.close(fd)
        return path

    def receive(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest], path: str,
                context: grpc.ServicerContext) -> bytes | str:
        """The payload: in the spec itself, or following it in ``requests``; in
        memory when it is small (it then travels to the worker inline), else
        written to ``path``. The spec keeps no copy of it."""
        if spec.payload:
            data = spec.payload
            spec.ClearField("payload")
            if len(data) != spec.payload_size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"payload of {len(data)} bytes in the spec, which announces "
                              f"{spec.payload_size}")
            self._check_digest(spec, digests.of(data), context)
            return data
        if spec.payload_size <= INLINE_BYTES:
            data = bytearray()
            self._take(spec, requests, context, data.extend)
            return bytes(data)
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(path, "wb", opener=_worker.private) as f:
                self._take(spec, requests, context, f.write)
            return path
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            abort(context, Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                f"the agent at {self._endpoint()} cannot store job {spec.job_id}'s payload "
                f"({spec.payload_size:,} bytes): {self._full_message()}. Nothing was run."))

    def _take(self, spec: pb.JobSpec, requests: Iterator[pb.RunRequest],
              context: grpc.ServicerContext, write) -> None:
        received = 0
        digest = digests.new()
        while received < spec.payload_size:
            req = next(requests, None)
            if req is None or not req.HasField("payload_chunk"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"payload truncated: got {received} of {spec.payload_size} "
                              "bytes")
            chunk = req.payload_chunk     # (each read of the field is a new copy)
            received += len(chunk)
            if received > spec.payload_size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"payload longer than the announced {spec.payload_size} "
                              "bytes")
            write(chunk)
            digest.update(chunk)
        self._check_digest(spec, digest.digest(), context)

    def _check_digest(self, spec: pb.JobSpec, digest: bytes,
                      context: grpc.ServicerContext) -> None:
        if digest != spec.payload_digest:
            context.set_trailing_metadata(((ERROR_KIND_KEY, "integrity"),))
            context.abort(grpc.StatusCode.DATA_LOSS,
                          f"the payload received by the agent at {self._endpoint()} does not "
                          f"match its {digests.NAME} digest: it was corrupted or altered on the "
                          "way. Nothing was run.")
