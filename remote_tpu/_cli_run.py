"""`remote-tpu run SCRIPT [ARGS...]` and `remote-tpu exec -- COMMAND...`: the
way in for people who start programs from a shell, as they did with
`gcloud compute tpus tpu-vm ssh --worker=all --command ...`.

`run` runs a whole script on every host as ``__main__`` (``sys.argv`` set),
under an initialized ``jax.distributed``; the leader's output streams; the exit
status is the script's: 0, the ``sys.exit`` code of the root-cause host, or 1
with its traceback. `exec` runs a command on every host (no JAX), every line
prefixed with its host; every host's command runs to its end, and the status is
non-zero when any failed, naming which.

Their flags are the options table's (``_options.OPTIONS``): each option with
a ``Flag`` is one, parsed into the keyword ``run()`` takes. Without
``--accelerator`` (and ``$REMOTE_TPU_ACCELERATOR``), the slice's agent is asked
for it: one found on a TPU VM knows it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._core.exceptions import (ConfigurationError, RemoteError, RemoteTPUError,
                               RemoteTraceback)
from ._core.proto import remote_tpu_pb2 as pb
from ._option_checks import hosts_text as hosts_arg, job_stem  # noqa: F401 - (_cli's)
from ._options import BY_NAME, OPTIONS


# `remote-tpu exec` runs a command on every host, not Python under JAX: the
# options that shape a Python worker are not its.
EXEC_OPTIONS = ("accelerator", "hosts", "timeout", "stream", "env", "working_dir",
                "output_dir", "num_slices", "name")

RUN_EPILOG = """examples:
  remote-tpu run --accelerator tpu-v4-16 --hosts local train.py --lr 0.1
      a simulated slice on this machine, the script's arguments after it
  remote-tpu run --hosts 10.0.0.2 --working-dir . --requirements requirements.txt train.py
      a real slice (its accelerator asked of its agent), the project sent along
  remote-tpu run --detach --name nightly --retries 3 --output-dir gs://bucket/runs eval.py
      submitted: follow it with `remote-tpu jobs logs -f JOB_ID`

every option, its variable and its meaning: docs/options.md"""

EXEC_EPILOG = """examples:
  remote-tpu exec --hosts 10.0.0.2 -- df -h /
      one program and its arguments, on every host
  remote-tpu exec --hosts 10.0.0.2 -- 'pip list | grep jax'
      one string: run by each host's shell
  remote-tpu exec --stream leader --timeout 60 -- uptime
      only host 0's output; every host's command ends within a minute"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run a Python script on every host of a slice, as "
                                   "__main__ under jax.distributed",
                       epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option_flags(r, [o.name for o in OPTIONS])
    r.add_argument("--detach", action="store_true",
                   help="submit and print the job id; `remote-tpu jobs` follows it")
    r.add_argument("script", nargs="?", help="the script (sent by content; with --working-dir, run "
                                  "from the project's copy on each host): a relative path "
                                  "is looked for in --working-dir first, then here")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    r.set_defaults(func=_run)
    e = sub.add_parser("exec", help="run a command on every host of a slice (no JAX), each "
                                    "line prefixed with its host",
                       epilog=EXEC_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option_flags(e, EXEC_OPTIONS, defaults={"stream": "all"})
    e.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: one string runs in the shell, several words as a program")
    e.set_defaults(func=_exec)


def _parsed(flag: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, its errors said by argparse as the flag's."""
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    typed.__name__ = flag
    return typed


def add_option_flags(p: argparse.ArgumentParser, names: Sequence[str],
                     defaults: Mapping[str, object] | None = None) -> None:
    """The flags of the options ``names`` that have one, from the table; a
    flag not given is None, so the option's variable, then its default, apply."""
    for option in OPTIONS:
        flag = option.flag
        if flag is None or option.name not in names:
            continue
        said = (flag.help or option.help) + (" (repeatable)" if flag.many else "")
        if option.env:
            said += f" (default ${option.env}" + (", else asked of the slice's agent)"
                                                  if option.name == "accelerator" else ")")
        kw: dict[str, Any] = {"dest": option.name, "help": said,
                              "default": (defaults or {}).get(option.name)}
        if flag.switch is not None:
            kw.update(action="store_const", const=flag.switch)
        elif flag.choices:
            kw.update(choices=flag.choices)
        else:
            kw.update(type=_parsed(option.cli, flag.parse), metavar=flag.metavar or None,
                      action="append" if flag.many else "store")
        p.add_argument(option.cli, **kw)


def option_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The ``run()`` keywords of the flags given (the others left out)."""
    out = {}
    for option in OPTIONS:
        value = getattr(args, option.name, None)
        if option.flag is None or value is None:
            continue
        out[option.name] = option.flag.collect(value) if option.flag.many else value
    return out


def with_flags(message: str) -> str:
    """A message about options, with the flags that give them here."""
    named = [o for o in OPTIONS if o.flag is not None and
             re.search(rf"(?<![\w.]){o.name}(=|\.| must)", message)]
    if not named:
        return message
    return (message.rstrip(".") + "; on the command line, " +
            ", ".join(f"{o.name}= is {o.cli}" for o in named))


def asked_accelerator(hosts: object) -> str:
    """The accelerator of the slice behind ``hosts`` (or ``$REMOTE_TPU_HOSTS``),
    as its agent (or, for tpu://, the Cloud TPU API) knows it."""
    from ._core.addresses import parse_hosts
    from ._core.channels import health
    from ._target import resolve_target

    parsed = parse_hosts(hosts)          # type: ignore[arg-type]
    if parsed.local:
        raise ConfigurationError("a local slice takes its shape from --accelerator: give one, "
                                 "e.g. --accelerator tpu-v4-16 (or set "
                                 "REMOTE_TPU_ACCELERATOR)")
    if parsed.tpu_url:
        from ._cloud import resolve as resolve_tpu
        accelerator, where = resolve_tpu(parsed.tpu_url)[1], parsed.tpu_url
    else:
        target = resolve_target(parsed)
        accelerator = target.call(lambda t: health(t.gateway, t.credentials)).accelerator
        where = f"the agent at {target.gateway}"
    if not accelerator:
        raise ConfigurationError(
            f"{where} does not know its slice's accelerator (its agents were given their "
            "peers, not found on a TPU VM): give --accelerator, e.g. --accelerator "
            "tpu-v4-16, or set REMOTE_TPU_ACCELERATOR")
    return accelerator


def script_name(script: str) -> str:
    """The job name of a script: ``sub/train.py`` -> ``sub-train``, as typed
    (only its file name when it is absolute or above this directory)."""
    shown = os.path.normpath(script)
    if os.path.isabs(shown) or shown.startswith(os.pardir):
        shown = os.path.basename(shown)
    return job_stem(shown[:-len(".py")] if shown.endswith(".py") else shown)


class ScriptNotFound(Exception):
    """No file at any of the places a script's path may mean."""


def find_script(script: str, working_dir: str | None) -> tuple[str, str]:
    """The file ``remote-tpu run SCRIPT`` runs, and a note to show ("" when
    none): a relative path is looked for in ``--working-dir`` first (the
    script runs there, as a Ray job's entrypoint does), then in this
    directory; where both have a different file, the working dir's is run and
    the note says so. None there: ScriptNotFound names every place looked."""
    if working_dir and not os.path.isdir(working_dir):
        raise ScriptNotFound(f"--working-dir {working_dir!r} is not a directory here "
                             f"({os.path.abspath(working_dir)}): give the project's path "
                             "from this directory")
    if os.path.isabs(script) or not working_dir:
        if not os.path.exists(script):
            raise ScriptNotFound(f"cannot find the script {script!r}: there is no "
                                 f"{os.path.abspath(script)}")
        return script, ""
    in_project = os.path.join(working_dir, script)
    places = [(in_project, f"in --working-dir {working_dir}"), (script, "in this directory")]
    there = [(path, where) for path, where in places if os.path.isfile(path)]
    if not there:
        looked = "; ".join(f"{os.path.abspath(path)} ({where})" for path, where in places)
        raise ScriptNotFound(f"cannot find the script {script!r}: looked for {looked}; give "
                             "its path from here, or from the --working-dir")
    if len(there) == 2 and not os.path.samefile(in_project, script):
        return in_project, (f"{script!r} is both in --working-dir {working_dir} and in this "
                            f"directory: running {os.path.abspath(in_project)}, the working "
                            f"dir's (to run this directory's, give its full path, "
                            f"{os.path.abspath(script)})")
    return there[0][0], ""


def _in_project(value: str, working_dir: str) -> str:
    """A ``--requirements`` file named from the project, as the script may
    be: looked for here first, then in ``--working-dir``."""
    if os.path.isabs(value) or os.path.isfile(value):
        return value
    in_project = os.path.join(working_dir, value)
    return in_project if os.path.isfile(in_project) else value


def _remote(args: argparse.Namespace, fn, **extra):
    import remote_tpu

    keywords = {**option_keywords(args), **extra}
    try:
        if keywords.get("accelerator") is None and not os.environ.get(
                BY_NAME["accelerator"].env):
            keywords["accelerator"] = asked_accelerator(keywords.get("hosts"))
        return remote_tpu.run(**keywords)(fn)
    except ConfigurationError as exc:
        raise ConfigurationError(with_flags(str(exc))) from None


def _run(args: argparse.Namespace) -> int:
    from ._script import run_script

    if not args.script:
        print("remote-tpu run: give the script to run, after the options, e.g. "
              "`remote-tpu run --hosts 10.0.0.2 train.py --lr 0.1`", file=sys.stderr)
        return 2
    try:
        found, note = find_script(args.script, args.working_dir)
        with open(found, encoding="utf-8") as f:
            source = f.read()
    except ScriptNotFound as exc:
        print(f"remote-tpu run: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"remote-tpu run: cannot read the script {args.script!r}: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"remote-tpu run: {note}", file=sys.stderr)
    if args.working_dir and getattr(args, "requirements", None):
        args.requirements = [_in_project(value, args.working_dir)
                             for value in args.requirements]
    path = os.path.basename(found)
    if args.working_dir:
        inside = os.path.relpath(os.path.abspath(found), os.path.abspath(args.working_dir))
        path = path if inside.startswith("..") else inside
    fn = _remote(args, run_script, **({} if args.name else {"name": script_name(args.script)}))
    from ._outcome import LOOK_IN
    LOOK_IN.append(os.path.dirname(os.path.abspath(found)))
    if args.detach:
        if fn.options.local:
            print("remote-tpu run: --detach needs a slice that outlives this command; a "
                  "local slice ends with it (start one with `remote-tpu local`)",
                  file=sys.stderr)
            return 2
        handle = fn.submit(source, path, list(args.args), args.script)
        print(f"job {handle.id} submitted; follow it with `remote-tpu jobs logs -f "
              f"{handle.id} --hosts {handle._target.gateway}` and `remote-tpu jobs result "
              f"{handle.id} --hosts {handle._target.gateway}`")
        return 0
    return script_status(lambda: fn(source, path, list(args.args), args.script))[0]


def script_status(call: Callable[[], Any]) -> tuple[int, Any]:
    """``call()`` (a script's run, or its detached job's result), ended as a
    shell ends a script: (exit status, value). A ``sys.exit(n)``: n; Ctrl-C:
    130; the script's error: its traceback on its host and the hosts'
    summary, 1. remote_tpu's own errors go on to the command line (status 1)."""
    from ._script import ScriptExit

    try:
        return 0, call()
    except ScriptExit as exc:
        if isinstance(exc.code, int):
            return exc.code & 0xFF or 1, None
        print(exc.code, file=sys.stderr)
        return 1, None
    except KeyboardInterrupt:
        return 130, None
    except BrokenPipeError:
        raise                                        # stdout's reader left (_cli.main)
    except RemoteError as exc:                       # the script's, not rebuilt here
        _print_script_error(exc)
        return 1, None
    except RemoteTPUError:
        raise                                        # said by the command line, status 1
    except Exception as exc:  # noqa: BLE001 - the script's own error, as Python shows it
        _print_script_error(exc)
        return 1, None


def _print_script_error(exc: BaseException) -> None:
    """The script's traceback on its host and the hosts' summary: none of
    this command's own frames (unless REMOTE_TPU_SHOW_SDK_FRAMES is set)."""
    from ._core.user_source import show_sdk_frames

    remote = exc.__cause__
    if show_sdk_frames() or not isinstance(remote, RemoteTraceback):
        traceback.print_exception(exc)
        return
    print(str(remote).strip("\n"), file=sys.stderr)
    for note in [str(exc)] if isinstance(exc, RemoteError) else getattr(exc, "__notes__", ()):
        print(note, file=sys.stderr)


def _exec(args: argparse.Namespace) -> int:
    from ._script import run_command

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("remote-tpu exec: give the command after --, e.g. "
              "`remote-tpu exec --hosts 10.0.0.2 -- df -h /`", file=sys.stderr)
        return 2
    fn = _remote(args, run_command, init_jax=False, **({} if args.name else {"name": "exec"}))
    fn.options = dataclasses.replace(fn.options, keep_going=True)
    try:
        fn(command)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - which hosts failed, from the job's end
        end = getattr(exc, "remote_tpu_end", None)
        if end is None:
            raise
        failed = [r for r in end.hosts if r.state != pb.HOST_STATE_SUCCEEDED]
        words = [f"host {r.host} ({r.exception.message or r.detail or 'failed'})"
                 for r in failed]
        print(f"remote-tpu exec: the command failed on {len(failed)} of {len(end.hosts)} "
              f"host(s): {'; '.join(words)}", file=sys.stderr)
        root = getattr(exc, "returncode", None)
        return root if isinstance(root, int) and 0 < root < 256 else 1
    return 0
