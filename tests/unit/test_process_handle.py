"""The gateway drives its own workers and its peers' processes through one
contract (``worker.handle.ProcessHandle``): both keep it."""

from __future__ import annotations

import inspect

import pytest

from remote_tpu._core.channels import Credentials
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.gateway.peer_process import RemoteHost
from remote_tpu_agent.worker.call import Call
from remote_tpu_agent.worker.handle import ProcessHandle
from remote_tpu_agent.worker.run import WorkerRun

pytestmark = pytest.mark.timeout(30)


def _handles(tmp_path):
    local = WorkerRun(host=0, call=Call(job_dir=str(tmp_path), env={}, payload=b"", digest=""),
                      emit=lambda event: None, forward_output=False)
    remote = RemoteHost(host=1, address="127.0.0.1:1", spec=pb.JobSpec(job_id="j"),
                        payload=b"", emit=lambda event: None, credentials=Credentials())
    return [local, remote]


def test_a_local_worker_and_a_peers_process_are_both_process_handles(tmp_path):
    for handle in _handles(tmp_path):
        assert isinstance(handle, ProcessHandle), type(handle).__name__


@pytest.mark.parametrize("name", ["start", "stacks", "release", "cancel", "close", "stop"])
def test_each_method_of_the_contract_takes_no_arguments_in_both(tmp_path, name):
    for handle in _handles(tmp_path):
        required = [p for p in inspect.signature(getattr(handle, name)).parameters.values()
                    if p.default is inspect.Parameter.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert not required, f"{type(handle).__name__}.{name} needs {required}"
