"""`remote-tpu run SCRIPT` and `remote-tpu exec -- COMMAND`, as a shell user
runs them: subprocesses against real agents."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def slice_(agents):
    return agents


def _cli(slice_, *argv: str, cwd: str | None = None, timeout: float = 120):
    env = {**os.environ, "REMOTE_TPU_TOKEN": slice_.token, "REMOTE_TPU_HOSTS": slice_.addresses[0],
           "REMOTE_TPU_ACCELERATOR": "tpu-v4-16"}
    return subprocess.run([sys.executable, "-m", "remote_tpu", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


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
