"""`remote-tpu run`'s flags come from the options table: each option that
makes sense for a script is a flag, parsed into the keyword run() takes.
(tests/slice/test_cli_run.py runs each new flag against real agents.)"""

from __future__ import annotations

import argparse

import pytest

import remote_tpu
from conftest import run_python
from remote_tpu._cli_run import (add_parsers, option_keywords, script_name, with_flags)
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._options import OPTIONS, JaxTimeouts

pytestmark = pytest.mark.timeout(60)

# The options of run() that `remote-tpu run` has no flag for, and why.
NOT_FLAGS = {
    # A secret on a command line is seen by every user of the machine (ps) and
    # kept in shell histories: REMOTE_TPU_TOKEN or REMOTE_TPU_TOKEN_FILE give it.
    "token",
    # An object (remote_tpu.TLS); its REMOTE_TPU_TLS_* variables give it.
    "tls",
    # Warm workers serve this process's next call; the command's process ends
    # with the script, and its warm workers are released as it exits.
    "keep_warm",
    # Where local remote_tpu.Data *arguments* go; a script's arguments are
    # strings, so it has none.
    "staging",
    # A script has no return value to collect from every process.
    "all_results",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remote-tpu")
    add_parsers(p.add_subparsers(dest="command"))
    return p


def _run_flags() -> dict[str, argparse.Action]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: a for a in sub.choices["run"]._actions for flag in a.option_strings}


def test_every_option_but_the_excluded_is_a_flag_of_remote_tpu_run():
    flagless = {o.name for o in OPTIONS if o.flag is None}
    assert flagless == set(NOT_FLAGS), "give the option a Flag, or say here why it has none"
    flags = _run_flags()
    for o in OPTIONS:
        if o.flag is not None:
            assert o.cli in flags and flags[o.cli].dest == o.name, o.name


# One use of each flag, and the keyword run() gets from it.
SAMPLES = {
    "accelerator": (["--accelerator", "tpu-v4-16"], "tpu-v4-16"),
    "hosts": (["--hosts", "10.0.0.1, 10.0.0.2"], ["10.0.0.1", "10.0.0.2"]),
    "timeout": (["--timeout", "2.5"], 2.5),
    "stream": (["--stream", "none"], "none"),
    "env": (["--env", "A=1", "--env", "B=x=y"], {"A": "1", "B": "x=y"}),
    "jax_timeouts": (["--jax-timeouts", "heartbeat=60,shutdown=9"],
                     JaxTimeouts(heartbeat=60, shutdown=9)),
    "processes_per_host": (["--processes-per-host", "2"], 2),
    "init_jax": (["--no-jax"], False),
    "working_dir": (["--working-dir", "proj"], "proj"),
    "output_dir": (["--output-dir", "gs://b/p"], "gs://b/p"),
    "requirements": (["--requirements", "numpy>=2", "--requirements=--no-index"],
                     ["numpy>=2", "--no-index"]),
    "allow_jax_requirements": (["--allow-jax-requirements"], True),
    "retries": (["--retries", "3"], 3),
    "num_slices": (["--num-slices", "2"], 2),
    "profile": (["--profile", "call"], True),
    "name": (["--name", "nightly"], "nightly"),
    "compilation_cache": (["--compilation-cache", "off"], False),
    "stall_after": (["--stall-after", "90"], 90.0),
    "on_stall": (["--on-stall", "cancel"], "cancel"),
}


def test_each_flag_gives_its_keyword_and_no_flag_gives_none():
    assert set(SAMPLES) == {o.name for o in OPTIONS if o.flag is not None}
    for name, (argv, expected) in SAMPLES.items():
        args = _parser().parse_args(["run", *argv, "x.py", "--its", "own"])
        assert option_keywords(args) == {name: expected}, name
        assert args.script == "x.py" and args.args == ["--its", "own"]
    assert option_keywords(_parser().parse_args(["run", "x.py"])) == {}
    profile = _parser().parse_args(["run", "--profile", "0.5", "x.py"])
    assert option_keywords(profile) == {"profile": 0.5}


@pytest.mark.parametrize("argv, said", [
    (["--timeout", "soon"], "argument --timeout: 'soon': not a number of seconds"),
    (["--retries", "many"], "argument --retries: 'many': not a whole number"),
    (["--env", "NOVALUE"], "argument --env: 'NOVALUE': write NAME=VALUE"),
    (["--jax-timeouts", "beat=3"], "KEY one of initialization, heartbeat, shutdown"),
    (["--profile", "always"], "give 'call' (the whole call) or a number of seconds"),
    (["--stream", "some"], "invalid choice: 'some'"),
])
def test_a_bad_flag_value_is_said_with_the_flag(capsys, argv, said):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["run", *argv, "x.py"])
    assert info.value.code == 2
    assert said in capsys.readouterr().err


def test_requirements_are_one_file_specs_or_files_lines(tmp_path):
    from remote_tpu._option_checks import requirement_args

    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# pinned\nnumpy>=2\n")
    assert requirement_args([str(reqs)]) == str(reqs)                 # as requirements= takes it
    assert requirement_args([str(reqs), "tqdm"]) == ["# pinned", "numpy>=2", "tqdm"]
    with pytest.raises(ConfigurationError, match="'nope.txt': no such file"):
        requirement_args(["nope.txt"])


def test_a_script_names_its_job():
    assert script_name("sub/bad.py") == "sub-bad"
    assert script_name("./train.py") == "train"
    assert script_name("/home/me/proj/train.py") == "train"
    assert script_name("../other/eval.py") == "eval"
    assert script_name("run me!") == "run-me"


def test_an_options_message_names_the_flags_that_give_them():
    said = with_flags("profile= writes each host's trace: pass output_dir='gs://b/p'")
    assert said.endswith("; on the command line, output_dir= is --output-dir, "
                         "profile= is --profile")
    assert with_flags("jax_timeouts.heartbeat must be positive").endswith(
        "jax_timeouts= is --jax-timeouts")
    assert with_flags("env= name '1A' is not a valid variable name").endswith(
        "env= is --env")                               # not --name
    assert with_flags("nothing of ours") == "nothing of ours"


def test_version_flag():
    proc = run_python("import sys; from remote_tpu._cli import main; "
                      "sys.argv = ['remote-tpu', '--version']; main()")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"remote-tpu {remote_tpu.__version__}"


def test_run_help_shows_examples():
    proc = run_python("from remote_tpu._cli import main; main(['run', '--help'])")
    assert proc.returncode == 0, proc.stderr
    examples = proc.stdout.split("examples:", 1)[1]
    assert examples.count("remote-tpu run ") == 3
    assert "docs/options.md" in examples


def test_a_local_slice_needs_an_accelerator(monkeypatch, tmp_path):
    monkeypatch.delenv("REMOTE_TPU_ACCELERATOR", raising=False)
    (tmp_path / "x.py").write_text("print('never')\n")
    proc = run_python("from remote_tpu._cli import main; "
                      "raise SystemExit(main(['run', '--hosts', 'local', 'x.py']))",
                      cwd=tmp_path)
    assert proc.returncode == 1
    assert "a local slice takes its shape from --accelerator" in proc.stderr
