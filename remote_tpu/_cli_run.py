"""`remote-tpu run SCRIPT [ARGS...]` and `remote-tpu exec -- COMMAND...`: the
way in for people who start programs from a shell, as they did with
`gcloud compute tpus tpu-vm ssh --worker=all --command ...`.

`run` runs a whole script on every host as ``__main__`` (``sys.argv`` set),
under an initialized ``jax.distributed``; the leader's output streams; the exit
status is the script's: 0, the ``sys.exit`` code of the root-cause host, or 1
with its traceback. `exec` runs a command on every host (no JAX), every line
prefixed with its host; every host's command runs to its end, and the status is
non-zero when any failed, naming which.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

from ._core.exceptions import (ConfigurationError, RemoteError, RemoteTPUError,
                               RemoteTraceback)
from ._core.proto import remote_tpu_pb2 as pb


def hosts_arg(value: str) -> str | list[str] | None:
    """``--hosts a,b`` -> ``["a", "b"]``, ``--hosts a`` -> ``"a"``, ``""`` -> None
    (``$REMOTE_TPU_HOSTS``)."""
    entries = [h.strip() for h in value.split(",") if h.strip()]
    return entries[0] if len(entries) == 1 else (entries or None)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run a Python script on every host of a slice, as "
                                   "__main__ under jax.distributed")
    _options(r, stream="leader")
    r.add_argument("--detach", action="store_true",
                   help="submit and print the job id; `remote-tpu jobs` follows it")
    r.add_argument("script", help="the script (sent by content; with --working-dir, run "
                                  "from the project's copy on each host)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    r.set_defaults(func=_run)
    e = sub.add_parser("exec", help="run a command on every host of a slice (no JAX), each "
                                    "line prefixed with its host")
    _options(e, stream="all")
    e.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: one string runs in the shell, several words as a program")
    e.set_defaults(func=_exec)


def _options(p: argparse.ArgumentParser, stream: str) -> None:
    p.add_argument("--accelerator", default=None,
                   help="e.g. tpu-v5p-32 (default REMOTE_TPU_ACCELERATOR)")
    p.add_argument("--hosts", default="", help="an agent address of the slice, 'local', "
                                               "tpu://NAME?zone=... (default REMOTE_TPU_HOSTS)")
    p.add_argument("--num-slices", type=int, default=None, help="several slices (multislice)")
    p.add_argument("--timeout", type=float, default=None, help="seconds, on every host")
    p.add_argument("--stream", default=stream, choices=("leader", "all", "none"))
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable for every host (repeatable)")
    p.add_argument("--working-dir", default=None, help="a project directory sent to every host")
    p.add_argument("--output-dir", default=None, help="gs://bucket/prefix or a local directory")


def _remote(args: argparse.Namespace, fn, **extra):
    import remote_tpu

    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigurationError(f"--env {item!r}: write NAME=VALUE")
        env[name] = value
    return remote_tpu.run(accelerator=args.accelerator, hosts=hosts_arg(args.hosts) or None,
                          timeout=args.timeout, stream=args.stream, env=env,
                          working_dir=args.working_dir, output_dir=args.output_dir,
                          num_slices=args.num_slices, **extra)(fn)


def _run(args: argparse.Namespace) -> int:
    from ._script import ScriptExit, run_script

    try:
        with open(args.script, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"remote-tpu run: cannot read the script {args.script!r}: {exc}", file=sys.stderr)
        return 2
    path = os.path.basename(args.script)
    if args.working_dir:
        inside = os.path.relpath(os.path.abspath(args.script), os.path.abspath(args.working_dir))
        path = path if inside.startswith("..") else inside
    fn = _remote(args, run_script)
    from ._outcome import LOOK_IN
    LOOK_IN.append(os.path.dirname(os.path.abspath(args.script)))
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
    try:
        fn(source, path, list(args.args), args.script)
    except ScriptExit as exc:
        if isinstance(exc.code, int):
            return exc.code & 0xFF or 1
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except RemoteError as exc:                       # the script's, not rebuilt here
        _print_script_error(exc)
        return 1
    except RemoteTPUError:
        raise                                        # said by the command line, status 1
    except Exception as exc:  # noqa: BLE001 - the script's own error, as Python shows it
        _print_script_error(exc)
        return 1
    return 0


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
    fn = _remote(args, run_command, init_jax=False)
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
