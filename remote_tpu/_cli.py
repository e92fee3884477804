"""`remote-tpu`: the client's command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from ._core.exceptions import ConfigurationError, RemoteTPUError
from ._core.addresses import HOSTS_ENV
from ._core.versions import __version__, local_versions
from ._cli_cloud import add_parsers as add_cloud_parsers
from ._cli_gke import add_parsers as add_gke_parsers
from ._cli_jobs import add_parser as add_jobs_parser
from ._cli_run import add_parsers, hosts_arg as _hosts_arg


def _version(args: argparse.Namespace) -> int:
    out = {"client": local_versions()}
    if args.hosts:
        from ._core.channels import health
        from ._target import resolve_target

        target = resolve_target(_hosts_arg(args.hosts))
        v = target.call(lambda t: health(t.gateway, t.credentials)).versions
        out["agent"] = {"address": target.gateway, "protocol": v.protocol,
                        "remote_tpu": v.remote_tpu, "python": v.python,
                        "cloudpickle": v.cloudpickle, "jax": v.jax}
    print(json.dumps(out, indent=2))
    return 0


def _local(args: argparse.Namespace) -> int:
    from ._local_slice import get_local_slice, stop_local_slices
    from ._core.topology import Topology

    topology = Topology.parse(args.accelerator)
    s = get_local_slice(topology)
    print(f"local {topology.name}: {topology.hosts} agent(s) x {topology.devices_per_host} "
          f"CPU device(s); logs in {s.log_dir} (removed when it stops)")
    print(f"REMOTE_TPU_HOSTS={','.join(s.addresses)}", flush=True)
    print(f"REMOTE_TPU_TOKEN={s.credentials.token}", flush=True)
    print("Ctrl-C stops the slice.", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except KeyboardInterrupt:
        pass
    stop_local_slices()
    return 0


def _release(args: argparse.Namespace) -> int:
    from ._jobs import release_targets
    from ._target import running_targets

    replies = release_targets(running_targets(_hosts_arg(args.hosts)))
    for _, detail in replies:
        print(detail)
    if not replies:
        print("this process runs no local slice: nothing to release")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import doctor, doctor_slices, format_table

    given = args.hosts or [s for s in os.environ.get(HOSTS_ENV, "").split(";") if s]
    if not given:
        print("remote-tpu doctor: give the slice's gateway address (or any agent of it), "
              "e.g. `remote-tpu doctor 10.0.0.2`; for several slices, one of each",
              file=sys.stderr)
        return 2
    if len(given) > 1:
        rows, problems = doctor_slices([_hosts_arg(h) for h in given])
    else:
        rows, problems = doctor(_hosts_arg(given[0]))
    print(format_table(rows))
    if problems:
        print("\nproblems:\n" + "\n".join(f"- {p}" for p in problems))
        return 1
    print("\nall hosts ready")
    return 0


RawHelp = argparse.RawDescriptionHelpFormatter

EPILOGS = {
    None: """examples:
  remote-tpu run --accelerator tpu-v4-16 --hosts local train.py
  remote-tpu jobs list --hosts 10.0.0.2
  remote-tpu doctor 10.0.0.2

each command's own: remote-tpu COMMAND --help""",
    "version": """examples:
  remote-tpu version
  remote-tpu version --hosts 10.0.0.2          the agent's versions too""",
    "local": """examples:
  remote-tpu local                             a tpu-v4-16: 2 agents on this machine
  remote-tpu local --accelerator tpu-v5p-32    4 agents; other shells use them with
      the REMOTE_TPU_HOSTS and REMOTE_TPU_TOKEN it prints""",
    "doctor": """examples:
  remote-tpu doctor 10.0.0.2
  remote-tpu doctor                            the slice of $REMOTE_TPU_HOSTS
  remote-tpu doctor 10.0.0.2 10.0.1.2          two slices, and the DCN between them""",
    "top": """examples:
  remote-tpu top --hosts 10.0.0.2                   the slice's running job, refreshed
  remote-tpu top train-3f2a9c0d1e2f --once          one screen
  remote-tpu top train-3f2a9c0d1e2f --json | jq '.[] | .steps_per_second'""",
    "release": """examples:
  remote-tpu release --hosts 10.0.0.2
  REMOTE_TPU_HOSTS=10.0.0.2 remote-tpu release""",
}


def _command(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, epilog=EPILOGS[name],
                          formatter_class=RawHelp)


def _top(args: argparse.Namespace) -> int:
    from ._jobs import attach, jobs
    from ._top import top

    if not 0 < args.interval <= 3600:
        raise ConfigurationError(f"--interval {args.interval:g}: give a number of seconds "
                                 "above 0, up to 3600")
    if not args.hosts.strip() and not os.environ.get(HOSTS_ENV, "").strip():
        raise ConfigurationError(f"which slice? give an agent's address with --hosts, or set "
                                 f"{HOSTS_ENV}")
    hosts = _hosts_arg(args.hosts)
    job_id = args.job_id or next((j.id for j in jobs(hosts) if j.state == "RUNNING"), "")
    if not job_id:
        raise ConfigurationError("no job is running on this slice now: give a job id "
                                 "(`remote-tpu jobs list` shows them)")
    handle = attach(job_id, hosts)
    try:
        return top(handle, args.json, args.once, args.interval)
    except KeyboardInterrupt:
        return 0


def parser() -> argparse.ArgumentParser:
    """The whole command line: every command, its flags and examples."""
    p = argparse.ArgumentParser(prog="remote-tpu", description="remote_tpu client tools",
                                epilog=EPILOGS[None], formatter_class=RawHelp)
    p.add_argument("--version", action="version", version=f"remote-tpu {__version__}",
                   help="print the client's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = _command(sub, "version", "print client (and, with --hosts, agent) versions")
    v.add_argument("--hosts", default="", help="an agent address to ask as well")
    v.set_defaults(func=_version)
    loc = _command(sub, "local", "start a local simulated slice and keep it up")
    loc.add_argument("--accelerator", default="tpu-v4-16",
                     help="the slice to simulate: one agent per host (default tpu-v4-16)")
    loc.set_defaults(func=_local)
    d = _command(sub, "doctor", "check every host of a slice: reachable, versions, "
                                "slice shape, TPU lock")
    d.add_argument("hosts", nargs="*", help="an agent address of the slice (default "
                                            "REMOTE_TPU_HOSTS); several slices: one of "
                                            "each, slice 0 first (their DCN links are "
                                            "checked too)")
    d.set_defaults(func=_doctor)
    t = _command(sub, "top", "a running job's hosts, refreshed: state, step and steps/s, "
                             "CPU, memory, output rate, TPU")
    t.add_argument("job_id", nargs="?", default="", help="the job (default: the slice's "
                                                         "running job)")
    t.add_argument("--hosts", default="", help="an agent address of the slice "
                                               "(default REMOTE_TPU_HOSTS)")
    t.add_argument("--json", action="store_true", help="every host's metrics once, as JSON")
    t.add_argument("--once", action="store_true", help="one screen, not refreshed")
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between refreshes (default 1)")
    t.set_defaults(func=_top)
    r = _command(sub, "release", "end a slice's warm workers (keep_warm) now")
    r.add_argument("--hosts", default="", help="an agent address of the slice "
                                               "(default REMOTE_TPU_HOSTS)")
    r.set_defaults(func=_release)
    add_jobs_parser(sub)
    add_parsers(sub)
    add_cloud_parsers(sub)
    add_gke_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.error("give a command: run, exec, jobs, top, doctor, local, release, setup, up, "
                "down, slices, gke or version "
                "(`remote-tpu --help` says what each does)")
    if args.command == "local":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        return args.func(args)
    except RemoteTPUError as exc:
        print(f"remote-tpu: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: each command has said what it leaves (up: the request stands,
        # and how to delete it); no traceback, a shell's status for SIGINT.
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # stdout's reader is gone (`remote-tpu run x.py | head -1`): a shell's
        # status for it, and no traceback, now or when Python flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
