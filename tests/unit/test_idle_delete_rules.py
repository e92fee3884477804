"""``--idle-delete``: its flags, the idle clock, and the delete itself against
stand-ins of the metadata server and the Cloud TPU API (real HTTP servers on
loopback). The agents that do it end to end: tests/slice/test_idle_delete.py."""

from __future__ import annotations

import re
import threading
import time

import pytest

from conftest import wait_until
from metadata_server import MetadataStandIn
from remote_tpu_agent.host.idle import IdleClock
from remote_tpu_agent.host.idle_delete import (CLOUD_PLATFORM, SliceDeleter, check_minutes,
                                               check_resource)
from remote_tpu_agent.server import cli
from remote_tpu_agent.wire.discovery import MetadataServer
from tpu_api import CloudTpuStandIn

pytestmark = pytest.mark.timeout(60)

PARENT = "projects/my-project/locations/us-central2-b"
QUEUED = f"{PARENT}/queuedResources/my-slice"


# ---------------------------------------------------------------- flags

@pytest.mark.parametrize("text,minutes", [("30", 30.0), ("0.05", 0.05), (" 1e1 ", 10.0)])
def test_minutes_may_be_fractions(text, minutes):
    assert check_minutes(text) == minutes


@pytest.mark.parametrize("text,said", [
    ("abc", "is not a number of minutes (e.g. 30, or 0.5 for 30 s)"),
    ("0", "give minutes above 0 and at most 10080 (a week)"),
    ("-5", "give minutes above 0"), ("nan", "give minutes above 0"),
    ("inf", "give minutes above 0"), ("20000", "at most 10080"),
])
def test_bad_minutes_say_what_to_give(text, said):
    with pytest.raises(ValueError, match="--idle-delete") as info:
        check_minutes(text)
    assert said in str(info.value)


@pytest.mark.parametrize("text", [QUEUED, f"{PARENT}/nodes/node-1", f"/{QUEUED}/",
                                  "projects/123456789/locations/europe-west4-a/nodes/a"])
def test_a_queued_resource_or_a_node_is_named_in_full(text):
    assert check_resource(text) == text.strip("/")


@pytest.mark.parametrize("text", ["my-slice", f"{PARENT}/tpus/my-slice",
                                  f"{PARENT}/queuedResources/", f"{QUEUED}/extra",
                                  "https://tpu.googleapis.com/v2/" + QUEUED,
                                  f"{PARENT}/queuedResources/My_Slice"])
def test_anything_else_is_refused_naming_both_forms(text):
    with pytest.raises(ValueError) as info:
        check_resource(text)
    message = str(info.value)
    assert message.startswith(f"--idle-delete-resource {text!r} is not a queued resource")
    assert "projects/PROJECT/locations/ZONE/queuedResources/NAME" in message
    assert "projects/PROJECT/locations/ZONE/nodes/NAME" in message


def _serve_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(["--port", "0", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def test_the_agent_refuses_bad_values_at_once(capsys):
    err = _serve_error(capsys, "--idle-delete", "soon", "--idle-delete-resource", QUEUED)
    assert "argument --idle-delete: 'soon' is not a number of minutes" in err
    err = _serve_error(capsys, "--idle-delete", "5", "--idle-delete-resource", "my-slice")
    assert "argument --idle-delete-resource: 'my-slice' is not a queued resource" in err


@pytest.mark.parametrize("argv", [["--idle-delete", "5"], ["--idle-delete-resource", QUEUED]])
def test_the_two_flags_go_together(capsys, argv):
    err = _serve_error(capsys, *argv)
    assert "--idle-delete MINUTES and --idle-delete-resource NAME go together" in err


def test_both_flags_are_taken():
    args = cli._serve_parser().parse_args(["--idle-delete", "0.5",
                                           "--idle-delete-resource", QUEUED])
    assert (args.idle_delete, args.idle_delete_resource) == (0.5, QUEUED)
    off = cli._serve_parser().parse_args([])
    assert (off.idle_delete, off.idle_delete_resource) == (0.0, None)     # off by default


# ---------------------------------------------------------------- the clock

class Rings:
    def __init__(self, done: bool = True) -> None:
        self.times: list[float] = []
        self.done = done

    def __call__(self, idle: float) -> bool:
        self.times.append(idle)
        return self.done


def test_the_clock_rings_once_idle_long_enough_and_never_while_held():
    rings = Rings()
    clock = IdleClock(0.3, rings).start()
    try:
        clock.note(True)                        # a job runs
        time.sleep(0.6)
        assert rings.times == [] and clock.idle_for() == 0.0
        with clock.hold():
            clock.note(False)                   # the job ended, a payload comes in
            time.sleep(0.5)
            assert rings.times == []
        started = time.monotonic()
        assert wait_until(lambda: rings.times, 5, interval=0.01)
        assert time.monotonic() - started >= 0.25
        assert rings.times[0] >= 0.3 and clock.done
    finally:
        clock.stop()


def test_work_that_comes_starts_the_idle_time_again():
    rings = Rings()
    clock = IdleClock(0.4, rings).start()
    try:
        for _ in range(4):                      # 0.8 s in all, never 0.4 s idle
            time.sleep(0.2)
            clock.touch()
        assert rings.times == []
        assert wait_until(lambda: rings.times, 5, interval=0.01)
    finally:
        clock.stop()


def test_a_try_that_fails_is_tried_again_after_another_idle_time():
    rings = Rings(done=False)
    clock = IdleClock(0.2, rings).start()
    try:
        assert wait_until(lambda: len(rings.times) >= 2, 5, interval=0.01)
        assert not clock.done
    finally:
        clock.stop()


def test_a_clock_that_never_rings_has_no_thread():
    before = threading.active_count()
    clock = IdleClock.never().start()
    clock.note(True)
    with clock.hold():
        clock.touch()
    assert threading.active_count() == before and clock.idle_for() >= 0


# ---------------------------------------------------------------- the delete

@pytest.fixture
def api(monkeypatch):
    stand_in = CloudTpuStandIn(["10.0.0.2"])
    stand_in.bearer = "vm-token"
    monkeypatch.setenv("REMOTE_TPU_TPU_API", stand_in.url)
    yield stand_in
    stand_in.close()


@pytest.fixture
def vm():
    server = MetadataStandIn({})
    server.service_account("vm-token", [CLOUD_PLATFORM,
                                        "https://www.googleapis.com/auth/userinfo.email"])
    yield server
    server.close()


def _deleter(vm, resource: str = QUEUED) -> SliceDeleter:
    return SliceDeleter(30, resource, MetadataServer(vm.address, attempts=1))


def test_the_queued_resource_goes_with_its_nodes_asked_with_the_vms_token(api, vm, caplog):
    api.add_queued_resource(PARENT, "my-slice", "v4-16")
    deleter = _deleter(vm)
    deleter.check_access()
    assert deleter.status() == ("idle-delete after 30 min: on", "")
    assert deleter.delete(1800.0)
    assert api.resources == {} and api.nodes == {}
    method, path, _ = api.requests[-1]
    assert (method, path) == ("DELETE", f"/v2/{QUEUED}")
    line, problem = deleter.status()
    assert line.startswith("idle-delete after 30 min: deleting since ") and "operation" in line
    assert problem == ""
    assert f"idle for 30.0 min (--idle-delete 30): deleting {QUEUED}" in caplog.text


def test_a_node_without_a_queued_resource_is_deleted_without_force(api, vm):
    api.add_node(PARENT, "by-hand", "v4-8")
    assert _deleter(vm, f"{PARENT}/nodes/by-hand").delete(60.0)
    assert api.nodes == {}


def test_a_refusal_is_kept_for_doctor_and_tried_again(api, vm):
    api.add_queued_resource(PARENT, "my-slice", "v4-16")
    api.forbid = "Permission 'tpu.queuedResources.delete' denied on 'my-slice'"
    deleter = _deleter(vm)
    assert not deleter.delete(1800.0)
    line, problem = deleter.status()
    assert re.fullmatch(r"idle-delete after 30 min: last try \(\d\d:\d\d:\d\d\) refused "
                        r"\(see problems\)", line), line
    assert problem.startswith(f"idle-delete after 30 min of {QUEUED}: last try (")
    assert ("refused: HTTP 403: Permission 'tpu.queuedResources.delete' denied on "
            "'my-slice' (the VM's service account needs the cloud-platform scope and a "
            "role with tpu.queuedResources.delete and tpu.nodes.delete, e.g. "
            "roles/tpu.admin)") in problem
    api.forbid = ""
    assert deleter.delete(1800.0) and deleter.status()[1] == ""
    assert api.resources == {}


def test_a_vm_without_the_cloud_platform_scope_is_told_at_start(api, vm, caplog):
    vm.service_account("vm-token", ["https://www.googleapis.com/auth/devstorage.read_only",
                                    "https://www.googleapis.com/auth/logging.write"])
    deleter = _deleter(vm)
    deleter.check_access()
    line, problem = deleter.status()
    assert line == "idle-delete after 30 min: will be refused (see problems)"
    assert ("will be refused: the VM's service account lacks the cloud-platform scope"
            in problem and "devstorage.read_only" in problem)
    assert problem.endswith("create the TPU VM with that scope, or delete it yourself "
                            "(remote-tpu down my-slice --zone us-central2-b --project "
                            "my-project)")
    assert "lacks the cloud-platform scope" in caplog.text
    vm.instance.pop("service-accounts/default/token")
    vm.instance.pop("service-accounts/default/scopes")
    deleter.check_access()
    assert "will be refused: this VM has no service account" in deleter.status()[1]


def test_a_wrong_token_and_a_missing_resource_are_said(api, vm):
    vm.service_account("stale", [CLOUD_PLATFORM])
    deleter = _deleter(vm)
    assert not deleter.delete(60.0)
    assert "refused: HTTP 401: Request had invalid authentication" in deleter.status()[1]
    vm.service_account("vm-token", [CLOUD_PLATFORM])
    assert not deleter.delete(60.0)
    assert "failed: HTTP 404: " in deleter.status()[1]
    assert "check --idle-delete-resource" in deleter.status()[1]
    assert deleter.status()[0].endswith(") failed (see problems)")


def test_an_api_that_does_not_answer_is_said(api, vm, monkeypatch):
    monkeypatch.setenv("REMOTE_TPU_TPU_API", "http://127.0.0.1:9")     # discard: refused
    deleter = _deleter(vm)
    assert not deleter.delete(60.0)
    assert "failed: cannot reach the Cloud TPU API at http://127.0.0.1:9" in \
        deleter.status()[1]
