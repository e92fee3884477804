"""output_dir=: every process's files saved to GCS (a real emulator) while the
job runs and as it ends, failed jobs included; or brought back to a local
directory on the client."""

from __future__ import annotations

import os
import time

import pytest

import remote_tpu
from remote_tpu._core.exceptions import ConfigurationError

from conftest import wait_until
from gcs_emulator import gcs  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.agents(extra=["--output-interval", "0.3"], after=["gcs"])]


def _on(agents, output_dir, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, init_jax=False, stream="none",
                          output_dir=output_dir, **kw)


def _objects(gcs, bucket: str, prefix: str = "") -> dict[str, bytes]:
    return {b.name: b.download_as_bytes()
            for b in gcs.client().list_blobs(bucket, prefix=prefix)}


def _write_outputs(fail: bool = False):
    import os

    import remote_tpu
    i = os.environ["JAX_PROCESS_ID"]
    own = remote_tpu.output_dir()
    os.makedirs(os.path.join(own, "ckpt"), exist_ok=True)
    with open(os.path.join(own, "ckpt", "step_1.bin"), "wb") as f:
        f.write(bytes([int(i)]) * 1000)
    open(os.path.join(own, "empty.txt"), "w").close()
    if i == "0":
        with open(os.path.join(remote_tpu.output_dir(shared=True), "summary.json"), "w") as f:
            f.write('{"loss": 0.5}')
    if fail and i == "1":
        import time
        time.sleep(1.5)               # host 0 has written its files and returned by then
        raise RuntimeError("host 1 broke after writing")
    return i


def test_every_hosts_files_land_under_the_job_id(gcs, agents, capfd):
    gcs.make_bucket("runs")
    handle = _on(agents, "gs://runs/exp/")(_write_outputs).submit()
    assert handle.result(timeout=60) == "0"
    got = _objects(gcs, "runs")
    job = f"exp/{handle.id}"
    assert got == {f"{job}/host_0/ckpt/step_1.bin": b"\0" * 1000,
                   f"{job}/host_1/ckpt/step_1.bin": b"\1" * 1000,
                   f"{job}/host_0/empty.txt": b"", f"{job}/host_1/empty.txt": b"",
                   f"{job}/summary.json": b'{"loss": 0.5}'}
    assert handle.outputs() == sorted(f"gs://runs/{name}" for name in got)
    capfd.readouterr()
    assert _on(agents, "gs://runs/again/")(_write_outputs)() == "0"     # a blocking call
    [line] = [x for x in capfd.readouterr().err.splitlines() if "output files" in x]
    job = line.split()[2].removesuffix("'s")
    assert line == (f"remote_tpu: job {job}'s output files: under gs://runs/again/{job}/ "
                    "(each host's, uploaded by its agent)")             # says where they are
    assert f"again/{job}/summary.json" in _objects(gcs, "runs", "again/")


def test_a_job_that_fails_after_writing_still_saves_its_files(gcs, agents):
    gcs.make_bucket("fails")
    with pytest.raises(RuntimeError, match="host 1 broke"):
        _on(agents, "gs://fails")(_write_outputs)(True)
    names = set(_objects(gcs, "fails"))
    assert {n.split("/", 1)[1] for n in names} >= {"host_0/ckpt/step_1.bin",
                                                   "host_1/ckpt/step_1.bin", "summary.json"}


def test_files_are_saved_while_the_job_runs(gcs, agents, tmp_path):
    gcs.make_bucket("live")
    go_on = str(tmp_path / "go-on")

    def slow(marker):
        import os
        import time

        import remote_tpu
        with open(os.path.join(remote_tpu.output_dir(), "early.txt"), "w") as f:
            f.write("written at the start")
        deadline = time.time() + 60
        while not os.path.exists(marker) and time.time() < deadline:
            time.sleep(0.05)
        return os.path.exists(marker)

    handle = _on(agents, "gs://live/run")(slow).submit(go_on)
    assert wait_until(lambda: any(n.endswith("host_0/early.txt")
                                  for n in _objects(gcs, "live")), timeout=30)
    assert handle.status().state == "RUNNING"                  # seen mid-job
    open(go_on, "w").close()
    assert handle.result(timeout=60) is True


def test_a_missing_bucket_is_said_with_what_to_do(gcs, agents, capfd):
    assert _on(agents, "gs://no-such-bucket/x")(_write_outputs)() == "0"
    err = capfd.readouterr().err
    assert "could not upload output gs://no-such-bucket/x/" in err
    assert "bucket no-such-bucket does not exist" in err
    assert "/host_1/ckpt/step_1.bin" in err                    # a peer's problem too


def test_a_local_output_dir_gets_every_hosts_files_back(agents, tmp_path, capfd):
    out = tmp_path / "outputs"
    fn = _on(agents, str(out))(_write_outputs)
    assert fn() == "0"
    (job,) = os.listdir(out)
    assert f"remote_tpu: job {job}'s output files: 5 files under {out}/{job}/" \
        in capfd.readouterr().err                               # where, and how many
    files = sorted(os.path.relpath(os.path.join(d, f), out / job)
                   for d, _, fs in os.walk(out / job) for f in fs)
    assert files == ["host_0/ckpt/step_1.bin", "host_0/empty.txt", "host_1/ckpt/step_1.bin",
                     "host_1/empty.txt", "summary.json"]
    assert (out / job / "host_1" / "ckpt" / "step_1.bin").read_bytes() == b"\1" * 1000
    with pytest.raises(RuntimeError):                          # failed: collected all the same
        fn(True)
    assert len(os.listdir(out)) == 2
    handle = fn.submit()
    handle.result(timeout=60)
    assert any(p.endswith("summary.json") for p in handle.outputs())
    assert os.path.isfile(out / handle.id / "host_0" / "ckpt" / "step_1.bin")


@pytest.mark.slow
def test_collected_output_names_follow_the_rule_for_names_from_elsewhere(agents, tmp_path,
                                                                         capfd):
    def write():
        import os

        import remote_tpu
        for name in ("kept.txt", "back\\slash.txt"):
            with open(os.path.join(remote_tpu.output_dir(), name), "w") as f:
                f.write(name)
    out = tmp_path / "outputs"
    _on(agents, str(out))(write)()
    (job,) = os.listdir(out)
    files = sorted(os.path.relpath(os.path.join(d, f), out / job)
                   for d, _, fs in os.walk(out / job) for f in fs)
    assert files == ["host_0/kept.txt", "host_1/kept.txt"]
    err = capfd.readouterr().err
    assert "skipped the output file 'host_0/back\\\\slash.txt': its name holds a backslash" in err


def test_bad_output_dirs_and_output_dir_outside_a_job(agents, tmp_path):
    for bad, words in (("s3://bucket/x", "only gs://"), ("gs://Bad_Bucket/x", "not a bucket"),
                       (42, "must be gs://")):
        with pytest.raises(ConfigurationError, match=words):
            _on(agents, bad)
    with pytest.raises(ConfigurationError, match="output_dir= set"):
        remote_tpu.output_dir()
    started = time.time()
    assert _on(agents, None)(lambda: __import__("os").environ.get(
        "REMOTE_TPU_OUTPUT_DIR"))() is None                     # none asked for: none made
    assert time.time() - started < 60


@pytest.mark.slow
def test_the_extraction_example_writes_every_hosts_activations(gcs):
    import subprocess
    import sys

    import numpy as np
    from conftest import ROOT

    gcs.make_bucket("acts")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "extract_to_gcs.py"),
                           "--output-dir", "gs://acts/run", "--examples", "10"],
                          capture_output=True, text=True, timeout=170, cwd=ROOT,
                          env={**os.environ, **gcs.env()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _objects(gcs, "acts")
    rows = {name.split("/")[2]: np.load(__import__("io").BytesIO(data)).shape
            for name, data in got.items() if name.endswith("activations.npy")}
    assert rows == {"host_0": (5, 16), "host_1": (5, 16)}
    assert any(name.endswith("/model.txt") for name in got)
    assert "gs://acts/run/" in proc.stdout and "host_1/activations.npy" in proc.stdout
