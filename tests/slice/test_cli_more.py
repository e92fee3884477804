"""The shell as a first-class citizen: `remote-tpu run` finds a script the
way a Ray job's entrypoint is found, `jobs status` reads as text, `jobs logs`
reads every host's log and its tail, every command's --help ends with
examples. Subprocesses of the real command against real agents."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import remote_tpu
from conftest import Agents, wait_until

pytestmark = pytest.mark.timeout(300)

TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


@pytest.fixture(scope="module")
def slice_():
    agents = Agents(2)
    yield agents
    agents.stop()


def _cli(slice_, *argv: str, cwd: str | None = None, timeout: float = 120):
    env = {**os.environ, "REMOTE_TPU_TOKEN": slice_.token,
           "REMOTE_TPU_HOSTS": slice_.addresses[0], "REMOTE_TPU_ACCELERATOR": "tpu-v4-16"}
    return subprocess.run([sys.executable, "-m", "remote_tpu", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _write(path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))


def _finished_job(slice_, tmp_path, body: str, *flags: str) -> str:
    """The id of a detached job of ``body``, once it has ended."""
    _write(tmp_path / "job.py", body)
    done = _cli(slice_, "run", "--no-jax", "--detach", *flags, str(tmp_path / "job.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[1]
    _cli(slice_, "jobs", "result", job_id)              # returns once the job has ended
    return job_id


# ---------------------------------------------------------------- finding the script

@pytest.mark.slow
def test_a_relative_script_is_found_in_the_working_dir(slice_, tmp_path):
    _write(tmp_path / "proj" / "train.py", """
        import os, time
        print("job", os.environ["REMOTE_TPU_JOB_ID"], flush=True)
        if os.environ["REMOTE_TPU_HOST_INDEX"] == "0":
            raise ValueError("from the project")
        time.sleep(60)
    """)
    done = _cli(slice_, "run", "--no-jax", "--working-dir", "proj", "train.py",
                cwd=str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^job train-[0-9a-f]{12}$", done.stdout, re.MULTILINE), done.stdout
    assert 'File "train.py", line 5, in <module>' in done.stderr     # as typed
    assert "ValueError: from the project" in done.stderr


@pytest.mark.slow
def test_a_script_in_both_places_runs_the_working_dirs_and_says_so(slice_, tmp_path):
    _write(tmp_path / "proj" / "train.py", 'print("the project\'s")\n')
    _write(tmp_path / "train.py", 'print("this directory\'s")\n')
    done = _cli(slice_, "run", "--no-jax", "--working-dir", "proj", "train.py",
                cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the project's" in done.stdout and "this directory's" not in done.stdout
    assert "'train.py' is both in --working-dir proj and in this directory" in done.stderr
    assert f"running {tmp_path / 'proj' / 'train.py'}, the working dir's" in done.stderr
    # The same file by two paths is no ambiguity.
    done = _cli(slice_, "run", "--no-jax", "--working-dir", ".", "train.py",
                cwd=str(tmp_path))
    assert done.returncode == 0 and "both" not in done.stderr, done.stderr


@pytest.mark.slow
def test_a_missing_script_names_every_place_looked(slice_, tmp_path):
    (tmp_path / "proj").mkdir()
    done = _cli(slice_, "run", "--working-dir", "proj", "train.py", cwd=str(tmp_path))
    assert done.returncode == 2
    assert "cannot find the script 'train.py': looked for " in done.stderr
    assert f"{tmp_path / 'proj' / 'train.py'} (in --working-dir proj)" in done.stderr
    assert f"{tmp_path / 'train.py'} (in this directory)" in done.stderr
    done = _cli(slice_, "run", "nowhere.py", cwd=str(tmp_path))
    assert done.returncode == 2
    assert f"there is no {tmp_path / 'nowhere.py'}" in done.stderr
    done = _cli(slice_, "run", "--working-dir", "nodir", "train.py", cwd=str(tmp_path))
    assert done.returncode == 2                    # the directory is what is missing
    assert f"--working-dir 'nodir' is not a directory here ({tmp_path / 'nodir'})" \
        in done.stderr, done.stderr


@pytest.mark.slow
def test_a_requirements_file_is_found_in_the_working_dir_as_the_script_is(slice_, tmp_path):
    """`--requirements requirements.txt` from outside the project reads the
    project's file (here one that asks for jax, refused before anything runs,
    which shows it was read; before: "no such file")."""
    _write(tmp_path / "proj" / "train.py", 'print("ran")\n')
    _write(tmp_path / "proj" / "requirements.txt", "jax==0.4.1\n")
    done = _cli(slice_, "run", "--no-jax", "--working-dir", "proj", "--requirements",
                "requirements.txt", "train.py", cwd=str(tmp_path))
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "jax" in done.stderr and "no such file" not in done.stderr, done.stderr


# ---------------------------------------------------------------- jobs status

@pytest.mark.slow
def test_jobs_status_reads_as_text_and_json_stays_as_it_was(slice_, tmp_path):
    import remote_tpu

    job_id = _finished_job(slice_, tmp_path, """
        import os, sys, time
        if os.environ["REMOTE_TPU_HOST_INDEX"] == "1":
            sys.exit(4)
        time.sleep(60)
    """)
    done = _cli(slice_, "jobs", "status", job_id)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert re.search(rf"^job: +{job_id}$", text, re.M), text
    assert re.search(r"^state: +FAILED$", text, re.M), text
    assert re.search(r"^accelerator: +tpu-v4-16$", text, re.M), text
    assert re.search(r"^hosts: +2$", text, re.M), text
    assert re.search(rf"^created: +{TIME}$", text, re.M), text
    assert re.search(rf"^started: +{TIME} \(queued for \d+\.\d s\)$", text, re.M), text
    assert re.search(rf"^ended: +{TIME} \(ran for \d+\.\d s\)$", text, re.M), text
    assert re.search(r"^root cause: +host 1 \(ScriptExit: the script called sys.exit\(4\)\)$",
                     text, re.M), text
    values = [line.index(":") + 1 + len(re.match(r"[^:]*:( *)", line)[1])
              for line in text.splitlines()]
    assert len(set(values)) == 1, text                     # one column of values
    status = remote_tpu.attach(job_id, hosts=slice_.addresses[0], token=slice_.token).status()
    done = _cli(slice_, "jobs", "status", "--json", job_id)
    assert json.loads(done.stdout) == json.loads(json.dumps(dataclasses.asdict(status)))


# ---------------------------------------------------------------- jobs logs

HOST_LINES = """
    import os
    i = os.environ["REMOTE_TPU_PROCESS_INDEX"]
    for n in range(4):
        print(f"line {n} of {i}")
    print(f"unfinished {i}", end="")
"""


@pytest.mark.slow
def test_jobs_logs_of_every_host_and_their_tails(slice_, tmp_path):
    job_id = _finished_job(slice_, tmp_path, HOST_LINES)
    done = _cli(slice_, "jobs", "logs", "--host", "all", job_id)
    assert done.returncode == 0, done.stderr
    # Merged in time order, each host's lines in their own order, each line
    # prefixed; a last line without its end is ended.
    lines = done.stdout.splitlines(keepends=True)
    for i in (0, 1):
        assert [line for line in lines if line.startswith(f"[host {i}] ")] == \
            [f"[host {i}] line {n} of {i}\n" for n in range(4)] + \
            [f"[host {i}] unfinished {i}\n"], done.stdout
    assert len(lines) == 10, done.stdout
    done = _cli(slice_, "jobs", "logs", "--host", "all", "--tail", "2", job_id)
    assert done.stdout == ("[host 0] line 3 of 0\n[host 0] unfinished 0\n"
                           "[host 1] line 3 of 1\n[host 1] unfinished 1\n"), done.stdout
    done = _cli(slice_, "jobs", "logs", "--host", "1", "--tail", "3", job_id)
    assert done.stdout == "line 2 of 1\nline 3 of 1\nunfinished 1", done.stdout
    done = _cli(slice_, "jobs", "logs", "-f", "--tail", "1", job_id)     # ended: no wait
    assert done.stdout == "unfinished 0", done.stdout
    done = _cli(slice_, "jobs", "logs", "--tail", "0", job_id)           # none of them
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    done = _cli(slice_, "jobs", "logs", "--tail", "10000000", job_id)    # the most: all
    assert done.stdout.endswith("line 3 of 0\nunfinished 0"), done.stdout


@pytest.mark.slow
def test_jobs_logs_of_every_host_merge_in_time_order_from_since(slice_, tmp_path):
    import datetime

    start = time.time() + 8                       # the hosts take turns from then on
    _write(tmp_path / "job.py", f"""
        import os, time
        i = int(os.environ["REMOTE_TPU_HOST_INDEX"])
        for turn in (1 - i, 3 - i, 5 - i):          # host 1 first
            time.sleep(max(0, {start} + 0.5 * turn - time.time()))
            print(f"turn {{turn}} by host {{i}}", flush=True)
        time.sleep(max(0, {start} + 5 - time.time()))
        print(f"late {{i}}", flush=True)
    """)
    done = _cli(slice_, "run", "--no-jax", "--detach", str(tmp_path / "job.py"))
    job_id = done.stdout.split()[1]
    handle = remote_tpu.attach(job_id, hosts=slice_.addresses[0], token=slice_.token)
    assert wait_until(lambda: "turn 5" in handle.logs(host=0), timeout=60)
    time.sleep(0.8)                  # between the turns and the late lines
    cut_at = time.time()
    cut = datetime.datetime.fromtimestamp(cut_at).isoformat()
    _cli(slice_, "jobs", "result", job_id)
    done = _cli(slice_, "jobs", "logs", "--host", "all", job_id)
    assert done.stdout.splitlines()[:6] == [
        f"[host {t % 2 == 0 and 1 or 0}] turn {t} by host {t % 2 == 0 and 1 or 0}"
        for t in range(6)], done.stdout
    assert handle.logs(host="all") == done.stdout                 # the same, in Python
    assert sorted(handle.logs(host="all", since=cut_at).splitlines()) == \
        ["[host 0] late 0", "[host 1] late 1"]
    done = _cli(slice_, "jobs", "logs", "--host", "all", "--grep", "turn [24]", job_id)
    assert done.stdout == "[host 1] turn 2 by host 1\n[host 1] turn 4 by host 1\n", \
        done.stdout
    done = _cli(slice_, "jobs", "logs", "--grep", "late", job_id)       # one host: lines
    assert done.stdout == "late 0\n", done.stdout
    done = _cli(slice_, "jobs", "logs", "--grep", "(", job_id)
    assert done.returncode == 2 and "is not a regular expression" in done.stderr
    done = _cli(slice_, "jobs", "logs", "--host", "all", "--since", cut, job_id)
    assert sorted(done.stdout.splitlines()) == ["[host 0] late 0", "[host 1] late 1"], \
        done.stdout
    done = _cli(slice_, "jobs", "logs", "--since", cut, job_id)          # one host's
    assert done.stdout == "late 0\n", done.stdout
    done = _cli(slice_, "jobs", "logs", "--host", "all", "--since", "1d", job_id)
    assert len(done.stdout.splitlines()) == 8, done.stdout
    done = _cli(slice_, "jobs", "logs", "--since", "yesterday-ish", job_id)
    assert done.returncode == 2 and "is not a time: give a duration ago" in done.stderr


@pytest.mark.slow
def test_jobs_logs_follows_every_host_as_it_writes(slice_, tmp_path):
    _write(tmp_path / "job.py", """
        import os, time
        i = os.environ["REMOTE_TPU_HOST_INDEX"]
        print("early", i, flush=True)
        time.sleep(4)
        for n in range(3):
            print("late", n, "of", i, flush=True)
            time.sleep(0.2)
    """)
    done = _cli(slice_, "run", "--no-jax", "--detach", str(tmp_path / "job.py"))
    job_id = done.stdout.split()[1]
    done = _cli(slice_, "jobs", "logs", "-f", "--host", "all", "--tail", "1", job_id)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for i in (0, 1):
        assert [line for line in lines if line.startswith(f"[host {i}] ")] == \
            [f"[host {i}] early {i}"] + [f"[host {i}] late {n} of {i}" for n in range(3)], lines


@pytest.mark.slow
def test_jobs_logs_says_what_is_wrong_with_its_flags(slice_, tmp_path):
    job_id = _finished_job(slice_, tmp_path, HOST_LINES)
    done = _cli(slice_, "jobs", "logs", "--host", "7", job_id)
    assert done.returncode == 1
    assert f"job {job_id} has 2 host(s): there is no --host 7; give --host 0 to 1, or " \
           "--host all" in done.stderr, done.stderr
    for bad in ("-3", "99999999999999999999", "x"):
        done = _cli(slice_, "jobs", "logs", "--tail", bad, job_id)
        assert done.returncode == 2
        assert f"argument --tail: '{bad}' is not a number of lines: give 0 to 10,000,000" \
            in done.stderr, done.stderr
    done = _cli(slice_, "jobs", "logs", "--host", "last", job_id)
    assert done.returncode == 2
    assert "argument --host: 'last' is not a host: give a host's index (0, 1, ...) or all" \
        in done.stderr


@pytest.mark.slow
def test_jobs_logs_of_several_processes_per_host_name_each_process(slice_, tmp_path):
    job_id = _finished_job(slice_, tmp_path, HOST_LINES, "--processes-per-host", "2")
    done = _cli(slice_, "jobs", "logs", "--host", "all", "--tail", "1", job_id)
    assert done.stdout == "".join(f"[process {i}] unfinished {i}\n" for i in range(4)), \
        done.stdout + done.stderr
    assert _cli(slice_, "jobs", "logs", "--host", "3", job_id).stdout.endswith("unfinished 3")
    done = _cli(slice_, "jobs", "logs", "--host", "4", job_id)
    assert "has 4 processes (2 host(s) x 2), one log each: there is no --host 4; give " \
           "--host 0 to 3" in done.stderr, done.stderr


# ---------------------------------------------------------------- help

def _parsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


@pytest.mark.timeout(60)
def test_every_command_has_examples_and_every_flag_says_what_it_is():
    from remote_tpu._cli import parser

    commands = list(_parsers(parser()))
    assert len(commands) >= 14
    for path, p in commands:
        said = p.format_help()
        examples = said[said.index("\nexamples:\n"):] if "\nexamples:\n" in said else ""
        assert 2 <= examples.count("\n  remote-tpu ") + examples.count(
            "\n  REMOTE_TPU_HOSTS=") <= 3, (path, said)
        silent = [a.option_strings or a.dest for a in p._actions
                  if not a.help and not isinstance(a, argparse._SubParsersAction)]
        assert not silent, (path, silent)
    # As a shell shows it.
    done = subprocess.run([sys.executable, "-m", "remote_tpu", "jobs", "logs", "--help"],
                          capture_output=True, text=True, timeout=30)
    assert "-f, --follow   keep printing what the job writes until it ends" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("  remote-tpu jobs logs")


@pytest.mark.timeout(60)
def test_a_command_missing_its_slice_script_or_action_says_what_to_give():
    env = {k: v for k, v in os.environ.items() if k != "REMOTE_TPU_HOSTS"}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "remote_tpu", *argv], env=env,
                              capture_output=True, text=True, timeout=30)

    done = cli("jobs", "status", "train-3f2a9c0d1e2f")
    assert done.returncode == 1
    assert "which slice? give the address of its gateway (any agent of it) with --hosts, " \
           "e.g. --hosts 10.0.0.2, or set REMOTE_TPU_HOSTS" in done.stderr, done.stderr
    done = cli("jobs")
    assert done.returncode == 2
    assert "give what to do: list, status, show, logs, result, cancel, stacks, stalls" in done.stderr
    done = cli()
    assert done.returncode == 2 and "give a command: run, exec, jobs" in done.stderr
    done = cli("run", "--detach")
    assert done.returncode == 2
    assert "give the script to run, after the options, e.g." in done.stderr


@pytest.mark.slow
def test_jobs_result_ends_as_run_ends_the_script(slice_, tmp_path):
    """`remote-tpu jobs result` of a detached script (what `run --detach`
    points to) ends as `remote-tpu run` would have: the script's exit status
    and traceback, not the command's own (before: the CLI's traceback of
    ScriptExit, status 1, and "None" for a script that succeeded)."""
    _write(tmp_path / "exits.py", "import sys\nprint('bye')\nsys.exit(5)\n")
    _write(tmp_path / "fails.py", "def step():\n    raise ValueError('bad step')\nstep()\n")
    _write(tmp_path / "works.py", "print('fine')\n")
    ended = {}
    for name in ("exits", "fails", "works"):
        job_id = _cli(slice_, "run", "--no-jax", "--detach",
                      str(tmp_path / f"{name}.py")).stdout.split()[1]
        ended[name] = _cli(slice_, "jobs", "result", job_id)
    assert (ended["exits"].returncode, ended["exits"].stdout) == (5, "")
    assert "Traceback" not in ended["exits"].stderr, ended["exits"].stderr
    assert ended["fails"].returncode == 1
    assert "ValueError: bad step" in ended["fails"].stderr
    assert "_cli" not in ended["fails"].stderr, ended["fails"].stderr     # none of ours
    assert (ended["works"].returncode, ended["works"].stdout) == (0, ""), ended["works"]
