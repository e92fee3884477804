"""`remote-tpu gke manifest`: the objects load as the `kubernetes` client's own
models where it has them (the Job inside the JobSet, its pod template, the
Services) and lose nothing on the way back; the JobSet's own fields, GKE's
node selectors and Kueue's label are what their documentation names; bad
input is a clear error; the Dockerfile installs what the pods run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._gke import dockerfile, manifest

kubernetes = pytest.importorskip("kubernetes")

pytestmark = pytest.mark.timeout(60)


def _model(data: dict, kind: str):
    """``data`` as the kubernetes client's model ``kind``; it must give back
    exactly ``data`` (no field unknown to the model, none of the wrong type)."""
    client = kubernetes.client.ApiClient()
    model = client._ApiClient__deserialize(data, kind)
    assert client.sanitize_for_serialization(model) == data, kind
    return model


def _jobset(objects: dict) -> dict:
    return next(o for o in objects["items"] if o["kind"] == "JobSet")


def _services(objects: dict) -> list[dict]:
    return [o for o in objects["items"] if o["kind"] == "Service"]


@pytest.mark.parametrize("accelerator, hosts, chips, gke, topology", [
    ("tpu-v5p-32", 4, "4", "tpu-v5p-slice", "2x2x4"),
    ("tpu-v6e-16", 4, "4", "tpu-v6e-slice", "4x4"),
    ("tpu-v6e-8", 1, "8", "tpu-v6e-slice", "2x4"),
    ("tpu7x-32", 4, "4", "tpu7x", "2x2x4"),     # one agent per VM runs its 2 processes
])
def test_the_manifest_loads_with_the_kubernetes_models(accelerator, hosts, chips, gke,
                                                       topology):
    objects = manifest(accelerator, name="train", image="r/agent:1", port=9475)
    assert (objects["apiVersion"], objects["kind"]) == ("v1", "List")
    jobset = _jobset(objects)
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    assert "labels" not in jobset["metadata"]
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True}
    [replicated] = jobset["spec"]["replicatedJobs"]
    assert (replicated["name"], replicated["replicas"]) == ("slice", 1)

    job = _model(replicated["template"]["spec"], "V1JobSpec")
    assert (job.parallelism, job.completions, job.completion_mode) == (hosts, hosts, "Indexed")
    pod = _model(replicated["template"]["spec"]["template"], "V1PodTemplateSpec").spec
    assert pod.node_selector == {"cloud.google.com/gke-tpu-accelerator": gke,
                                 "cloud.google.com/gke-tpu-topology": topology}
    [agent] = pod.containers
    assert agent.image == "r/agent:1"
    assert agent.resources.limits == agent.resources.requests == {"google.com/tpu": chips}
    assert agent.args[:4] == ["--host", "0.0.0.0", "--port", "9475"]
    token = agent.args[agent.args.index("--token-file") + 1]
    [mount] = agent.volume_mounts
    [volume] = pod.volumes
    assert token.startswith(mount.mount_path + "/") and mount.name == volume.name
    assert volume.secret.secret_name == "remote-tpu-token"
    assert volume.secret.default_mode == 0o400       # the agent demands an owner-only file

    [service] = [_model(s, "V1Service") for s in _services(objects)]
    assert service.metadata.name == "train-gateway"
    assert service.spec.selector == {"jobset.sigs.k8s.io/jobset-name": "train",
                                     "jobset.sigs.k8s.io/job-index": "0",
                                     "batch.kubernetes.io/job-completion-index": "0"}
    assert [p.port for p in service.spec.ports] == [9475]


def test_slices_and_a_kueue_queue():
    objects = manifest("tpu-v5p-32", num_slices=3, queue="team-a")
    jobset = _jobset(objects)
    assert jobset["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 3
    services = [_model(s, "V1Service") for s in _services(objects)]
    assert [s.metadata.name for s in services] == \
        ["remote-tpu-gateway", "remote-tpu-gateway-1", "remote-tpu-gateway-2"]
    assert [s.spec.selector["jobset.sigs.k8s.io/job-index"] for s in services] == \
        ["0", "1", "2"]


@pytest.mark.parametrize("kwargs, expected", [
    ({"accelerator": "tpu-v3-32"}, "GKE offers no v3 slices"),
    ({"accelerator": "tpu-v5p-33"}, "not a valid v5p size"),
    ({"accelerator": "tpu-v5p-32", "name": "Train_1"}, "--name 'Train_1' is not"),
    ({"accelerator": "tpu-v5p-32", "num_slices": 0}, "--num-slices 0"),
    ({"accelerator": "tpu-v5p-32", "queue": "a queue"}, "give the name of a Kueue"),
    ({"accelerator": "tpu-v5p-32", "port": 70000}, "--port 70000"),
    ({"accelerator": "tpu-v5p-32", "image": "a b"}, "--image 'a b'"),
])
def test_bad_input_says_what_to_give(kwargs, expected):
    with pytest.raises(ConfigurationError, match=expected):
        manifest(**kwargs)


def test_the_dockerfile_installs_the_agent_for_this_python():
    text = dockerfile("remote_tpu-0.1.0-py3-none-any.whl", 9475)
    assert f"FROM python:{sys.version_info.major}.{sys.version_info.minor}-slim" in text
    assert '"jax[tpu]' in text and "COPY remote_tpu-0.1.0-py3-none-any.whl /tmp/" in text
    assert 'ENTRYPOINT ["remote-tpu-agent"]' in text and "EXPOSE 9475" in text


def test_the_command_prints_or_writes_the_manifest(tmp_path):
    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "remote_tpu", "gke", *argv],
                              capture_output=True, text=True, timeout=30)

    done = cli("manifest", "--accelerator", "tpu7x-32")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == manifest("tpu7x-32")
    done = cli("manifest", "--accelerator", "tpu-v6e-16", "--out", str(tmp_path / "gke"))
    assert done.returncode == 0, done.stderr
    assert "kubectl port-forward service/remote-tpu-gateway 8475:8475" in done.stdout
    assert json.loads((tmp_path / "gke" / "jobset.json").read_text()) == \
        manifest("tpu-v6e-16")
    wheel, = [p.name for p in (tmp_path / "gke").glob("remote_tpu-*.whl")]
    assert (tmp_path / "gke" / "Dockerfile").read_text() == dockerfile(wheel)
    # The image gets this client's own modules: the wheel holds this very file.
    import zipfile
    with zipfile.ZipFile(tmp_path / "gke" / wheel) as z:
        assert z.read("remote_tpu/_gke.py") == open(manifest.__code__.co_filename, "rb").read()
    done = cli()
    assert done.returncode == 2 and "give what to do: manifest" in done.stderr
    done = cli("manifest", "--accelerator", "tpu-v2-8")
    assert done.returncode == 1 and "GKE offers no v2 slices" in done.stderr
