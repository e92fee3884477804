"""remote-tpu up, down and slices: Google's google-cloud-tpu library over its
REST transport against a stand-in of the Cloud TPU API (a real HTTP server,
tests/tpu_api.py); a real agent answers on a listed slice's first worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from tpu_api import CloudTpuStandIn

pytestmark = [pytest.mark.timeout(120), pytest.mark.agents(n=1, peers=False)]


@pytest.fixture
def api(monkeypatch):
    stand_in = CloudTpuStandIn(["127.0.0.1"], waits=2)
    monkeypatch.setenv("REMOTE_TPU_TPU_API", stand_in.url)
    monkeypatch.setenv("REMOTE_TPU_UP_POLL_SECONDS", "0.05")
    yield stand_in
    stand_in.close()


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_tpu", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, **env})


def test_up_waits_for_the_queued_resource_then_slices_lists_it_with_its_agent(api, agents):
    done = _cli("up", "my-slice", "--accelerator", "tpu-v4-16", "--zone", "us-x1-a",
                "--project", "p", "--spot", "--no-setup")
    assert done.returncode == 0, done.stderr
    assert "my-slice: WAITING_FOR_RESOURCES" in done.stdout
    assert done.stdout.index("PROVISIONING") < done.stdout.index("my-slice: ACTIVE")
    assert "remote-tpu down my-slice --zone us-x1-a --project p deletes it" in done.stdout
    (method, path, body), = [r for r in api.requests if r[0] == "POST"]
    assert path == "/v2/projects/p/locations/us-x1-a/queuedResources"
    spec = body["tpu"]["nodeSpec"][0]
    assert (spec["nodeId"], spec["node"]["acceleratorType"], spec["node"]["runtimeVersion"]) \
        == ("my-slice", "v4-16", "tpu-ubuntu2204-base")
    assert body["spot"] == {}
    port = agents.addresses[0].rsplit(":", 1)[1]
    listed = _cli("slices", "--zone", "us-x1-a", "--project", "p", "--agent-port", port,
                  "--json", REMOTE_TPU_TOKEN=agents.token)
    assert listed.returncode == 0, listed.stderr
    row, = json.loads(listed.stdout)
    assert (row["node"], row["queued_state"], row["node_state"], row["accelerator"]) == (
        "my-slice", "ACTIVE", "READY", "tpu-v4-16")
    assert row["agent"].startswith("agent ") and row["agent"].endswith(f"127.0.0.1:{port}")
    gone = _cli("down", "my-slice", "--zone", "us-x1-a", "--project", "p")
    assert gone.returncode == 0 and "deleted queued resource my-slice and its nodes" in \
        gone.stdout, gone.stderr
    assert api.resources == {} and api.nodes == {}
    assert ("DELETE", "/v2/projects/p/locations/us-x1-a/queuedResources/my-slice", {}) in \
        api.requests


def test_a_multislice_request_names_each_node_and_a_failed_one_says_why(api, monkeypatch):
    from remote_tpu import _tpu_api

    said: list[str] = []
    assert _tpu_api.up("two", "tpu-v5p-16", "z", "p", num_slices=2, reserved=True,
                       say=said.append) == ["two-0", "two-1"]
    body = [r for r in api.requests if r[0] == "POST"][0][2]
    assert body["tpu"]["nodeSpec"][0]["multisliceParams"] == {"nodeCount": 2,
                                                              "nodeIdPrefix": "two"}
    assert body["tpu"]["nodeSpec"][0]["node"]["schedulingConfig"] == {"reserved": True}
    api.fail = "no v5p capacity in z"
    with pytest.raises(_tpu_api.RemoteTPUError, match="queued resource none FAILED: no v5p "
                                                       "capacity in z"):
        _tpu_api.up("none", "tpu-v5p-16", "z", "p", say=said.append)
    again = []
    api.fail = ""
    assert _tpu_api.up("two", "tpu-v5p-16", "z", "p", num_slices=2, say=again.append) == \
        ["two-0", "two-1"]
    assert "exists already" in again[0]


def test_down_removes_a_hand_made_node_and_names_what_is_missing(api):
    api.add_node("projects/p/locations/z", "by-hand", "v4-8")
    done = _cli("down", "by-hand", "--zone", "z", "--project", "p")
    assert done.returncode == 0 and "deleted TPU node by-hand" in done.stdout, done.stderr
    missing = _cli("down", "nothing", "--zone", "z", "--project", "p")
    assert missing.returncode == 1
    assert "there is no queued resource or TPU node 'nothing' in zone z" in missing.stderr


def test_bad_requests_are_refused_before_the_api_is_asked(api):
    for args, said in [
        (["up", "x", "--accelerator", "tpu-v4-9", "--zone", "z", "--project", "p"],
         "tpu-v4-9"),
        (["up", "x", "--accelerator", "tpu-v4-8", "--zone", "z", "--project", "p",
          "--num-slices", "0"], "--num-slices 0: give 1 to 64"),
        (["up", "x", "--accelerator", "tpu-v4-8", "--zone", "z", "--spot", "--reserved"],
         "not allowed with argument"),
    ]:
        done = _cli(*args)
        assert done.returncode != 0 and said in done.stderr, (args, done.stderr)
    assert api.requests == []
    empty = _cli("slices", "--zone", "z", "--project", "p")
    assert empty.returncode == 0 and "no queued resources or TPU nodes" in empty.stdout


def test_ctrl_c_while_waiting_leaves_the_request_and_says_how_to_delete_it(api):
    import signal

    api.waits = 10 ** 6                         # WAITING_FOR_RESOURCES for good
    proc = subprocess.Popen([sys.executable, "-m", "remote_tpu", "up", "w", "--accelerator",
                             "tpu-v4-8", "--zone", "z", "--project", "p"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[1].startswith("w: WAITING_FOR_RESOURCES"), lines
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "stopped waiting; queued resource w stays WAITING_FOR_RESOURCES: remote-tpu down w " \
           "--zone z --project p deletes it" in out
    assert list(api.resources) == ["projects/p/locations/z/queuedResources/w"]
