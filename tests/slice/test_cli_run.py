"""`remote-tpu run SCRIPT` and `remote-tpu exec -- COMMAND`, as a shell user
runs them: subprocesses against real agents."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from package_index import make_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def slice_(agents):
    return agents


def _env(slice_, **more: str) -> dict[str, str]:
    return {**os.environ, "REMOTE_TPU_TOKEN": slice_.token,
            "REMOTE_TPU_HOSTS": slice_.addresses[0], "REMOTE_TPU_ACCELERATOR": "tpu-v4-16",
            **more}


def _cli(slice_, *argv: str, cwd: str | None = None, timeout: float = 120, **env: str):
    return subprocess.run([sys.executable, "-m", "remote_tpu", *argv], env=_env(slice_, **env),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _script(tmp_path, body: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_script_runs_on_every_host_as_main_with_its_arguments(slice_, tmp_path):
    (tmp_path / "helper.py").write_text("SCALE = 10\n")
    script = _script(tmp_path, """
        import sys
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils
        from helper import SCALE          # beside the script, sent with --working-dir

        # Already initialized by remote_tpu; a script that initializes JAX itself
        # (as MaxText's does) is told so and goes on.
        jax.distributed.initialize()

        def main():
            ones = multihost_utils.process_allgather(jnp.ones(jax.local_device_count()))
            print(f"argv={sys.argv[1:]} sum={float(ones.sum()) * SCALE} "
                  f"process={jax.process_index()}/{jax.process_count()}")

        if __name__ == "__main__":
            main()
    """)
    done = _cli(slice_, "run", "--working-dir", str(tmp_path), script, "--lr", "0.1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "argv=['--lr', '0.1'] sum=40.0 process=0/2" in done.stdout   # the leader's only
    assert "process=1/2" not in done.stdout


def test_a_scripts_exit_status_is_the_root_cause_hosts(slice_, tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        if os.environ["REMOTE_TPU_HOST_INDEX"] == "1":
            sys.exit(3)
        time.sleep(60)
    """)
    done = _cli(slice_, "run", script)
    assert done.returncode == 3, done.stdout + done.stderr
    script = _script(tmp_path, """
        import sys
        def load(name):
            raise FileNotFoundError(f"no dataset {name}")
        load(sys.argv[1])
    """, "broken.py")
    done = _cli(slice_, "run", script, "imagenet")
    assert done.returncode == 1
    assert "FileNotFoundError: no dataset imagenet" in done.stderr
    assert 'broken.py", line 4, in load' in done.stderr          # the script's own lines
    assert "raise FileNotFoundError" in done.stderr
    assert _cli(slice_, "run", str(tmp_path / "missing.py")).returncode == 2


def test_a_detached_script_is_followed_with_the_jobs_commands(slice_, tmp_path):
    script = _script(tmp_path, """
        print("detached and done")
    """)
    done = _cli(slice_, "run", "--detach", script)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[1]
    assert done.stdout.startswith(f"job {job_id} submitted")
    result = _cli(slice_, "jobs", "result", job_id)
    assert result.returncode == 0, result.stderr
    logs = _cli(slice_, "jobs", "logs", job_id)
    assert "detached and done" in logs.stdout


def test_exec_runs_a_command_on_every_host_and_names_those_that_failed(slice_):
    done = _cli(slice_, "exec", "--", "echo host $REMOTE_TPU_HOST_INDEX here")
    assert done.returncode == 0, done.stderr
    assert "[host 0] host 0 here\n" in done.stdout and "[host 1] host 1 here\n" in done.stdout
    done = _cli(slice_, "exec", "--", "sh", "-c", 'echo "$0" "$1"', "two", "words")
    assert "[host 1] two words\n" in done.stdout
    # Host 0 fails at once; host 1 still runs to its end (no fail-fast for exec).
    done = _cli(slice_, "exec", "--",
                'if [ "$REMOTE_TPU_HOST_INDEX" = 0 ]; then exit 7; fi; sleep 1; echo finished')
    assert done.returncode == 7, done.stdout + done.stderr
    assert "[host 1] finished" in done.stdout
    assert "the command failed on 1 of 2 host(s): host 0 (the command exited with 7)" \
        in done.stderr
    assert _cli(slice_, "exec").returncode == 2


# ---------------------------------------------------------------- the flags from the table
# Each runs the command against the agents and fails if its flag does not
# reach the hosts.

@pytest.mark.timeout(240)
def test_requirements_from_a_file_or_repeated_reach_every_host(slice_, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(str(wheels), "rtpu_test_cli")
    script = _script(tmp_path, """
        import rtpu_test_cli                  # only in the environment the flag makes
        print("answer", rtpu_test_cli.ANSWER)
    """)
    lines = ["--no-index", f"--find-links {wheels}", "rtpu-test-cli==1.0"]
    (tmp_path / "requirements.txt").write_text("\n".join(lines) + "\n")
    done = _cli(slice_, "run", "--requirements", str(tmp_path / "requirements.txt"), script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answer 42" in done.stdout
    done = _cli(slice_, "run", *[f"--requirements={line}" for line in lines], script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answer 42" in done.stdout


@pytest.mark.timeout(240)
def test_allow_jax_requirements_lets_a_requirement_name_cloudpickle(slice_, tmp_path):
    import cloudpickle

    script = _script(tmp_path, """
        print("installed")
    """)
    pin = f"--requirements=cloudpickle=={cloudpickle.__version__}"   # the host's own
    refused = _cli(slice_, "run", pin, script)
    assert refused.returncode == 1
    assert "allow_jax_requirements= is --allow-jax-requirements" in refused.stderr
    done = _cli(slice_, "run", pin, "--allow-jax-requirements", script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installed" in done.stdout


@pytest.mark.timeout(120)
def test_retries_run_a_failed_script_again(slice_, tmp_path):
    # The first attempt fails on the leader only, once its line is out: a
    # leader cancelled because another host failed first may not print it.
    script = _script(tmp_path, """
        import os, sys, time
        attempt = os.environ.get("REMOTE_TPU_ATTEMPT")
        print("attempt", attempt, flush=True)
        if attempt in (None, "0"):
            if os.environ["REMOTE_TPU_HOST_INDEX"] == "0":
                sys.exit(5)
            time.sleep(30)
    """)
    done = _cli(slice_, "run", "--retries", "1", script)       # (10 s between attempts)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attempt 0" in done.stdout and "attempt 1" in done.stdout


@pytest.mark.timeout(120)
def test_processes_per_host_start_that_many_jax_processes(slice_, tmp_path):
    script = _script(tmp_path, """
        import jax
        print(f"processes={jax.process_count()} devices={jax.local_device_count()}")
    """)
    done = _cli(slice_, "run", "--processes-per-host", "2", script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "processes=4 devices=1" in done.stdout


@pytest.mark.timeout(120)
def test_no_jax_and_jax_timeouts_reach_the_worker(slice_, tmp_path):
    script = _script(tmp_path, """
        import os
        print("init_jax", os.environ["REMOTE_TPU_INIT_JAX"],
              "heartbeat", os.environ["REMOTE_TPU_JAX_HEARTBEAT_TIMEOUT"])
    """)
    done = _cli(slice_, "run", "--no-jax", "--jax-timeouts", "heartbeat=33", script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "init_jax 0 heartbeat 33" in done.stdout


@pytest.mark.timeout(120)
def test_a_job_is_named_by_name_or_after_its_script(slice_, tmp_path):
    (tmp_path / "sub").mkdir()
    _script(tmp_path, """
        import os
        print("job", os.environ["REMOTE_TPU_JOB_ID"])
    """, "sub/bad.py")
    done = _cli(slice_, "run", "--no-jax", "sub/bad.py", cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^job sub-bad-[0-9a-f]{12}$", done.stdout, re.MULTILINE), done.stdout
    done = _cli(slice_, "run", "--no-jax", "--name", "nightly", "sub/bad.py", cwd=str(tmp_path))
    assert re.search(r"^job nightly-[0-9a-f]{12}$", done.stdout, re.MULTILINE), done.stdout
    detached = _cli(slice_, "run", "--detach", "--name", "later", "sub/bad.py",
                    cwd=str(tmp_path))
    assert detached.stdout.startswith("job later-"), detached.stdout + detached.stderr


@pytest.mark.timeout(180)
def test_profile_traces_every_host_into_the_output_dir(slice_, tmp_path):
    script = _script(tmp_path, """
        import jax.numpy as jnp
        print("sum", float(jnp.arange(4).sum()))
    """)
    out = tmp_path / "out"
    done = _cli(slice_, "run", "--output-dir", str(out), "--profile", "call", script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jax.profiler trace of job train-" in done.stderr
    for host in (0, 1):
        traces = list(out.glob(f"train-*/host_{host}/plugins/profile/*"))
        assert traces, sorted(str(p) for p in out.rglob("*"))


@pytest.mark.timeout(180)
def test_the_accelerator_is_asked_of_an_agent_that_knows_it(slice_, tmp_path):
    from metadata_server import MetadataSlice

    script = _script(tmp_path, """
        import jax
        print("processes", jax.process_count())
    """)
    vm = MetadataSlice("v4-16", 2)            # agents that found their slice on a TPU VM
    try:
        done = _cli(slice_, "run", "--hosts", vm.addresses[1], script,
                    REMOTE_TPU_ACCELERATOR="", REMOTE_TPU_TOKEN=vm.token)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "processes 2" in done.stdout
    finally:
        vm.stop()
    # Agents given their peers by flags do not know it: the command says what to give.
    done = _cli(slice_, "run", script, REMOTE_TPU_ACCELERATOR="")
    assert done.returncode == 1
    assert "does not know its slice's accelerator" in done.stderr
    assert "give --accelerator, e.g. --accelerator tpu-v4-16" in done.stderr


@pytest.mark.timeout(120)
def test_a_closed_stdout_ends_the_command_without_a_traceback(slice_, tmp_path):
    script = _script(tmp_path, """
        import time
        for i in range(400):
            print("line", i, flush=True)
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "remote_tpu", "run", "--no-jax", script],
                            env=_env(slice_), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "line 0\n"
    proc.stdout.close()                          # as `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(60) == 141, err             # 128 + SIGPIPE, as a shell shows it
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
