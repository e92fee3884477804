"""``--idle-delete``: a real agent deletes its slice once idle that long, through
a stand-in of the Cloud TPU API (tests/tpu_api.py, a real HTTP server) with the
token its metadata server (tests/metadata_server.py) hands the VM; never while
a job runs or a warm session holds the slice; and `remote-tpu doctor` says what
stands in its way where the VM may not delete it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, Agents, on_agents, running_agents, wait_until
from metadata_server import MetadataStandIn
from remote_tpu._core.exceptions import RemoteTPUError
from remote_tpu_agent.host.idle_delete import CLOUD_PLATFORM
from tpu_api import CloudTpuStandIn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PARENT = "projects/my-project/locations/us-central2-b"
MINUTES = 0.1                 # 6 s idle: the jobs below last longer


@pytest.fixture
def cloud():
    api = CloudTpuStandIn(["127.0.0.1"])
    api.bearer = "vm-token"
    vm = MetadataStandIn({})
    vm.service_account("vm-token", [CLOUD_PLATFORM])
    yield api, vm
    api.close()
    vm.close()


def _agent(cloud, resource: str, minutes: float = MINUTES):
    api, vm = cloud
    return running_agents(1, peers=False, extra=[
        "--idle-delete", str(minutes), "--idle-delete-resource", resource,
        "--spare-workers", "0", "--log-level", "INFO"],
        envs=[{"GCE_METADATA_IP": vm.address, "REMOTE_TPU_TPU_API": api.url}])


def _doctor(agents) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_tpu", "doctor", agents.addresses[0]],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "REMOTE_TPU_TOKEN": agents.token})


def test_an_idle_slice_is_deleted_but_never_while_a_job_runs(cloud):
    api, _ = cloud
    name = api.add_queued_resource(PARENT, "idle-1", "v5litepod-4")
    with _agent(cloud, name) as agents:
        @on_agents(agents, init_jax=False)
        def work():
            time.sleep(9)                     # longer than the idle time
            return "done"

        assert work() == "done"
        ended = time.monotonic()
        assert api.deletes == [], "deleted while a job ran"
        doctor = _doctor(agents)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "idle-delete after 0.1 min: on" in doctor.stdout
        assert wait_until(lambda: api.deletes, 30, interval=0.1), Agents.log(agents.logs[0])
        assert api.deletes[0] - ended >= MINUTES * 60 - 1.5      # counted from the job's end
        assert api.requests[-1][:2] == ("DELETE", f"/v2/{name}")
        assert api.resources == {} and api.nodes == {}
        doctor = _doctor(agents)
        assert "idle-delete after 0.1 min: deleting since " in doctor.stdout, doctor.stdout
        log = Agents.log(agents.logs[0])
        assert f"(--idle-delete 0.1): deleting {name}" in log
        assert "the Cloud TPU API is deleting" in log
        with pytest.raises(RemoteTPUError) as info:               # the VM goes soon
            on_agents(agents, init_jax=False)(len)("abc")
        assert ("is being deleted: it was idle for 0.1 min (--idle-delete) and the Cloud "
                "TPU API took the request; make another (remote-tpu up)") in str(info.value)
        time.sleep(MINUTES * 60 + 1)
        assert len(api.deletes) == 1                             # once taken, never again


def test_a_warm_session_holds_the_slice_until_it_ends(cloud):
    api, _ = cloud
    name = api.add_queued_resource(PARENT, "idle-2", "v5litepod-4")
    with _agent(cloud, name) as agents:
        assert on_agents(agents, init_jax=False, keep_warm=9)(len)("abc") == 3
        returned = time.monotonic()
        time.sleep(8)                         # the call is over, its workers kept
        assert api.deletes == [], "deleted while a warm session held the slice"
        assert wait_until(lambda: api.deletes, 30, interval=0.1), Agents.log(agents.logs[0])
        assert api.deletes[0] - returned >= 9 + MINUTES * 60 - 1.5
        assert api.resources == {}


def test_a_refusal_is_shown_by_doctor_and_the_slice_stays(cloud):
    api, _ = cloud
    name = api.add_queued_resource(PARENT, "idle-3", "v5litepod-4")
    api.forbid = "Permission 'tpu.queuedResources.delete' denied on resource 'idle-3'"
    with _agent(cloud, name, minutes=0.02) as agents:
        assert wait_until(lambda: api.deletes, 30, interval=0.1), Agents.log(agents.logs[0])
        doctor = _doctor(agents)
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        problems = doctor.stdout.split("problems:")[1]
        assert f"- host 0: idle-delete after 0.02 min of {name}: last try (" in problems
        assert ("refused: HTTP 403: Permission 'tpu.queuedResources.delete' denied on "
                "resource 'idle-3'") in problems
        assert name in api.resources
        assert "was not deleted: refused: HTTP 403" in Agents.log(agents.logs[0])


def test_a_vm_without_the_cloud_platform_scope_warns_at_start(cloud):
    api, vm = cloud
    vm.service_account("vm-token", ["https://www.googleapis.com/auth/devstorage.read_only"])
    name = f"{PARENT}/nodes/by-hand"
    api.add_node(PARENT, "by-hand", "v5litepod-4")
    with _agent(cloud, name, minutes=60) as agents:
        assert wait_until(lambda: "cloud-platform scope" in Agents.log(agents.logs[0]), 15)
        assert "WARNING" in Agents.log(agents.logs[0])
        doctor = _doctor(agents)
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        assert "idle-delete after 60 min: will be refused (see problems)" in doctor.stdout
        assert (f"- host 0: idle-delete after 60 min of {name}: will be refused: the VM's "
                "service account lacks the cloud-platform scope") in doctor.stdout
        assert api.deletes == []
