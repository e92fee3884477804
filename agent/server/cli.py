"""`remote-tpu-agent`: the daemon's entry point. The only place that configures logging.

    remote-tpu-agent [serve] [--host H] [--port P] ...    run the agent
    remote-tpu-agent token init [--path P] [--force]      create the slice token
    remote-tpu-agent install-service [--dry-run] [FLAGS]  run it under systemd
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading

from remote_tpu._core.addresses import DEFAULT_AGENT_PORT, is_loopback, normalize_address
from remote_tpu._core.auth import (TOKEN_ENV, check_token, default_token_file, new_token,
                                   read_token_file, write_token_file)
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.versions import __version__

from remote_tpu_agent.wire.discovery import discover
from remote_tpu_agent.jobs.host_log import DEFAULT_MAX_LOG_BYTES, MIN_LOG_BYTES
from remote_tpu_agent.host.config import AgentConfig
from remote_tpu_agent.host.idle_delete import check_minutes, check_resource
from remote_tpu_agent.server.service import create_server
from remote_tpu_agent.jobs.store import DEFAULT_MAX_STORE_BYTES
from remote_tpu_agent.host.tpu import DEFAULT_DEVICES, DEFAULT_LOCKFILE

log = logging.getLogger("remote_tpu_agent")
READY_PREFIX = "remote-tpu-agent listening on "


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="remote-tpu-agent",
        description="Serve remote_tpu jobs on this host (one agent per TPU VM). "
                    "`remote-tpu-agent token init` creates the slice token.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other address needs "
                        "TLS, or --insecure)")
    p.add_argument("--port", type=int, default=DEFAULT_AGENT_PORT,
                   help=f"port to listen on; 0 picks a free one (default {DEFAULT_AGENT_PORT})")
    p.add_argument("--advertise-address", default="",
                   help="address peers reach this host at (default: --host, or this "
                        "machine's hostname address when listening on all interfaces)")
    p.add_argument("--worker-id", type=int, default=None,
                   help="this host's index in the slice (0 = gateway); default: from "
                        "TPU_WORKER_ID or the TPU metadata server, else 0")
    p.add_argument("--peers", default="",
                   help="comma-separated agent addresses of every host, index = worker id; "
                        "default: from TPU_WORKER_HOSTNAMES or the TPU metadata server")
    p.add_argument("--print-slice", action="store_true",
                   help="print the slice this agent finds (worker id, peers, accelerator, "
                        "and where they came from) and exit")
    p.add_argument("--simulate-devices", type=int, default=0, metavar="K",
                   help="run JAX on CPU with K devices per process (local slice, tests)")
    p.add_argument("--state-dir", default="",
                   help="directory of the job store: records, logs, results (default: "
                        "$XDG_STATE_HOME/remote_tpu/agent-PORT, ~/.local/state/... )")
    p.add_argument("--keep-jobs", type=int, default=100,
                   help="finished jobs kept with their logs and results (default 100)")
    p.add_argument("--max-log-bytes", type=_size_arg, default=DEFAULT_MAX_LOG_BYTES,
                   help="output kept per host and job; beyond it the first and the last half "
                        "are kept and readers are told how much was cut and kept "
                        "(default 1G, at least 512; suffixes K, M, G)")
    p.add_argument("--max-store-bytes", type=_size_arg, default=DEFAULT_MAX_STORE_BYTES,
                   help="files of finished jobs kept in all; the oldest go first (default "
                        "32G; suffixes K, M, G)")
    p.add_argument("--max-streams", type=int, default=128,
                   help="long-lived calls served at once (attached runs, log followers, "
                        "uploads); more are refused with a clear error while Health, Status "
                        "and Cancel keep their own threads (default 128)")
    p.add_argument("--peer-timeout", type=float, default=10.0,
                   help="seconds of silence after which a peer counts as unreachable and "
                        "its job fails (default 10)")
    p.add_argument("--token-file", default="",
                   help=f"the slice token (default: ${TOKEN_ENV}, else {default_token_file()}, "
                        "created if missing)")
    p.add_argument("--tls-cert", default="", help="this agent's certificate (PEM)")
    p.add_argument("--tls-key", default="", help="this agent's private key (PEM)")
    p.add_argument("--tls-ca", default="",
                   help="CA certificate (PEM) that signed the slice's agents, to verify peers; "
                        "with --mtls also the clients")
    p.add_argument("--mtls", action="store_true",
                   help="demand a client certificate signed by --tls-ca (mutual TLS)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without TLS: the token is still "
                        "required on every call, but it, the code and the results travel in "
                        "clear, for anyone who can watch the network to read. Only on a "
                        "private network you trust")
    p.add_argument("--pass-env", default="",
                   help="comma-separated names of this agent's environment variables that "
                        "the processes it starts (user functions, installers) may see "
                        "(beyond PATH, HOME, locale, TPU/JAX/XLA ...; never REMOTE_TPU_*)")
    p.add_argument("--python", action="append", default=[], metavar="PATH",
                   help="an interpreter of another Python minor version, for clients that "
                        "run it (repeatable; else pythonX.Y on PATH, or uv's)")
    p.add_argument("--no-python-downloads", action="store_true",
                   help="never let uv download a Python a client needs")
    p.add_argument("--tpu-lockfile", default=DEFAULT_LOCKFILE,
                   help=f"libtpu's lock file (default {DEFAULT_LOCKFILE})")
    p.add_argument("--tpu-devices", default=",".join(DEFAULT_DEVICES),
                   help="comma-separated globs of the TPU device files (default "
                        f"{','.join(DEFAULT_DEVICES)})")
    p.add_argument("--kill-tpu-holders", action="store_true",
                   help="kill a process that is not ours holding the TPU, instead of "
                        "failing the job")
    p.add_argument("--max-payload-bytes", type=int, default=16 << 30,
                   help="largest function + arguments accepted (default 16 GiB)")
    p.add_argument("--cache-bytes", type=int, default=8 << 30,
                   help="the argument cache: large buffers of earlier calls kept for the "
                        "next, by content, least recently used out first; 0 = none "
                        "(default 8 GiB; emptied when the agent starts and stops)")
    p.add_argument("--compilation-cache-bytes", type=_size_arg, default=10 << 30,
                   help="JAX's persistent compilation cache for every job's workers, in "
                        "STATE_DIR/compilation-cache, least recently used out first; 0 = "
                        "none (default 10G; suffixes K, M, G; a call's "
                        "compilation_cache= may name another place or turn it off)")
    p.add_argument("--output-interval", type=float, default=30.0,
                   help="seconds between uploads of a running job's output_dir= files to "
                        "GCS (also uploaded as each process ends; default 30)")
    p.add_argument("--data-port", type=int, default=0,
                   help="the port for bulk bytes (large arguments, between agents and "
                        "from clients that reach it), beside the gRPC port: plain TCP, "
                        "each transfer let in by a ticket from a token-checked call; "
                        "never opened with TLS (gRPC carries them then). 0 = any free "
                        "port (default); -1 = none (gRPC carries them)")
    p.add_argument("--cache-dir", default="",
                   help="a directory to keep the argument cache in (a fast disk, say): "
                        "the agent makes a directory of its own there and only ever "
                        "empties and removes that one (default: in memory, under "
                        "/dev/shm, where this host has it; else in --state-dir)")
    p.add_argument("--spare-workers", type=int, default=1, choices=(0, 1),
                   help="workers kept started ahead of their job, jax imported (not "
                        "initialized: no TPU held), so a cold call skips that (default 1); "
                        "after a job with init_jax=False the next one comes without jax")
    p.add_argument("--light-spares", action="store_true",
                   help="the spare worker never imports jax ahead of its job (a job that "
                        "uses JAX imports it in its call): for many simulated hosts on one "
                        "machine, where a spare with jax for each would cost ~0.8 s of CPU "
                        "and ~150 MB; a spare taken is then replaced once its worker has "
                        "exited and the machine's CPUs are idle again, not during its call")
    p.add_argument("--idle-delete", type=_minutes_arg, default=0.0, metavar="MINUTES",
                   help="delete this slice once it has been idle that long (no job running "
                        "or queued, no warm session), as SkyPilot's autostop does: worker 0 "
                        "decides for the whole slice and asks the Cloud TPU API with the "
                        "VM's own service account (it needs the cloud-platform scope and "
                        "the right to delete it; where it lacks them the agent warns at "
                        "start and `remote-tpu doctor` says so). Fractions allowed (0.5 = "
                        "30 s); needs --idle-delete-resource (default: off)")
    p.add_argument("--idle-delete-resource", type=_resource_arg, default=None, metavar="NAME",
                   help="what --idle-delete deletes: projects/PROJECT/locations/ZONE/"
                        "queuedResources/NAME (with its nodes), or .../nodes/NAME for a TPU "
                        "VM made without a queued resource")
    p.add_argument("--exit-with-stdin", action="store_true",
                   help="shut down when standard input closes (the local slice uses this "
                        "so agents never outlive their client)")
    p.add_argument("--log-level", default=os.environ.get("REMOTE_TPU_AGENT_LOG", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--version", action="version", version=f"remote-tpu-agent {__version__}")
    return p


def _size_arg(text: str) -> int:
    """"1G", "512M", "64K" or a number of bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        number = int(value[:-1]) * units[value[-1]] if value[-1:] in units else int(value)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a number "
                                         "with K, M, G or T (e.g. 512M)") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return number


def _minutes_arg(text: str) -> float:
    try:
        return check_minutes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--idle-delete ")) from None


def _resource_arg(text: str) -> str:
    try:
        return check_resource(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).removeprefix("--idle-delete-resource ")) from None


def _token_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="remote-tpu-agent token",
                                description="Manage the slice's secret token.")
    sub = p.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="create a new random token file (mode 0600)")
    init.add_argument("--path", default=default_token_file())
    init.add_argument("--force", action="store_true", help="replace an existing token")
    args = p.parse_args(argv)
    try:
        write_token_file(args.path, new_token(), overwrite=args.force)
    except ConfigurationError as exc:
        print(f"remote-tpu-agent: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a new slice token to {args.path} (mode 0600).\n"
          "Every agent of the slice and every client needs the same token: copy this file "
          f"to the same place on each, or set {TOKEN_ENV} from it.")
    return 0


_UNIT = """\
[Unit]
Description=remote_tpu agent: runs remote_tpu jobs on this TPU VM
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={user}
Environment=PYTHONUNBUFFERED=1
ExecStart={exec_start}
Restart=on-failure
RestartSec=2
KillMode=mixed
TimeoutStopSec=15

[Install]
WantedBy=multi-user.target
"""


_ROOT_BY_DEFAULT = (
    "remote-tpu-agent install-service: without --user the agent would run as root (the "
    "user running this, as under sudo), and so would every function a token holder "
    "sends. Pass --user {suggested} to run it as that user (the one whose "
    "~/.config/remote_tpu/token it reads), or --user root if root is really meant.")


def _install_service_main(argv: list[str]) -> int:
    import getpass
    import shlex
    import shutil
    import subprocess

    p = argparse.ArgumentParser(
        prog="remote-tpu-agent install-service",
        description="Write and enable a systemd unit that runs this agent at boot. Agent "
                    "flags after the options below go into the unit (e.g. --host 0.0.0.0 "
                    "--tls-cert ...).")
    p.add_argument("--dry-run", action="store_true", help="print the unit and the commands")
    p.add_argument("--unit-path", default="/etc/systemd/system/remote-tpu-agent.service")
    p.add_argument("--user", default="", help="run the agent as this user (default: the "
                   "one running this; root only when named)")
    args, agent_args = p.parse_known_args(argv)
    _serve_parser().parse_args(agent_args)      # a typo fails here, not at boot
    user = args.user or getpass.getuser()
    if user == "root" and not args.user:
        print(_ROOT_BY_DEFAULT.format(suggested=os.environ.get("SUDO_USER") or "NAME"),
              file=sys.stderr)
        return 2
    exec_start = shlex.join([sys.executable, "-m", "remote_tpu_agent", *agent_args])
    unit = _UNIT.format(user=user, exec_start=exec_start)
    name = os.path.basename(args.unit_path)
    commands = [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", name]]
    if args.dry_run:
        print(f"# {args.unit_path}\n{unit}")
        for cmd in commands:
            print(shlex.join(cmd))
        return 0
    if shutil.which("systemctl") is None:
        print("remote-tpu-agent: systemctl not found: this host does not run systemd; start "
              f"`{exec_start}` another way, or use --dry-run to see the unit",
              file=sys.stderr)
        return 2
    try:
        with open(args.unit_path, "w") as f:
            f.write(unit)
    except OSError as exc:
        print(f"remote-tpu-agent: cannot write {args.unit_path}: {exc.strerror} (run it with "
              "sudo, or pick --unit-path)", file=sys.stderr)
        return 2
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"remote-tpu-agent: `{shlex.join(cmd)}` failed: {done.stderr.strip()}",
                  file=sys.stderr)
            return 2
    print(f"installed and started {name} ({args.unit_path}); logs: journalctl -u {name}")
    return 0


def _resolve_token(args: argparse.Namespace) -> str:
    """The slice token every call must carry (there is no agent without one):
    --token-file, $REMOTE_TPU_TOKEN, or the default file, created if missing."""
    if args.token_file:
        return read_token_file(args.token_file)
    if os.environ.get(TOKEN_ENV):
        return check_token(os.environ[TOKEN_ENV], f"${TOKEN_ENV}")
    path = default_token_file()
    if os.path.exists(path):
        return read_token_file(path)
    write_token_file(path, new_token())
    log.warning("no slice token was configured: created %s (mode 0600); clients on this "
                "machine use it as is, others need a copy", path)
    return read_token_file(path)


def _default_state_dir(port: int) -> str:
    if port == 0:        # an ephemeral agent: an ephemeral store (made, and removed, by it)
        return ""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return os.path.join(base, "remote_tpu", f"agent-{port}")


def _check_exposure(args: argparse.Namespace) -> str:
    """Why this configuration must not start, or ""."""
    if bool(args.tls_cert) != bool(args.tls_key):
        return "--tls-cert and --tls-key go together"
    if args.mtls and not args.tls_ca:
        return "--mtls needs --tls-ca, the CA that signs client certificates"
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            return f"--{flag.replace('_', '-')} {path}: no such file"
    if not is_loopback(args.host) and not args.insecure and not args.tls_cert:
        return (f"refusing to listen on {args.host} without TLS: the slice token, the code "
                "and the results would cross the network in clear, and whoever reads the "
                "token can run code as this user. Give --tls-cert/--tls-key, listen on "
                "127.0.0.1 behind an SSH tunnel, or pass --insecure on a private network you "
                "trust (the token stays required).")
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before any thread (each starts with its creator's mask): a parent that blocked
    # them (`remote-tpu local` waits for them so) would leave the agent and its workers deaf.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    if argv[:1] == ["token"]:
        return _token_main(argv[1:])
    if argv[:1] == ["install-service"]:
        return _install_service_main(argv[1:])
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = _serve_parser()
    args = parser.parse_args(argv)
    if bool(args.idle_delete) != bool(args.idle_delete_resource):
        parser.error("--idle-delete MINUTES and --idle-delete-resource NAME go together: "
                     "the one says when, the other what to delete")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)    # e.g. a peer reached without TLS: a log line, once
    if args.simulate_devices < 0:
        parser.error("--simulate-devices must be >= 0")
    if not 0.1 <= args.output_interval <= 86400:
        parser.error(f"--output-interval must be 0.1 to 86400 seconds, got "
                     f"{args.output_interval}")
    if args.max_log_bytes < MIN_LOG_BYTES:
        parser.error(f"--max-log-bytes must be at least {MIN_LOG_BYTES} (each host's log is "
                     "kept in eighths, each holding at least one record), got "
                     f"{args.max_log_bytes}")
    if args.cache_bytes < 0:
        parser.error(f"--cache-bytes must be >= 0, got {args.cache_bytes}")
    if not -1 <= args.data_port <= 65535:
        parser.error(f"--data-port must be a port (0 = any free one, -1 = none), got "
                     f"{args.data_port}")
    if args.data_port > 0 and args.data_port == args.port:
        parser.error(f"--data-port {args.data_port} is the agent's gRPC port (--port): "
                     "give it another, or 0 for any free one")
    for flag in ("keep_jobs", "max_streams"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, flag)}")
    peers = tuple(normalize_address(p) for p in args.peers.split(",") if p.strip())
    try:
        found = discover(port=args.port, worker_id=args.worker_id, peers=peers)
    except ConfigurationError as exc:
        print(f"remote-tpu-agent: cannot tell this host's place in its slice: {exc}",
              file=sys.stderr)
        return 2
    if args.print_slice:
        print(json.dumps(found.describe(), indent=2))
        return 0
    problem = _check_exposure(args)
    if problem:
        print(f"remote-tpu-agent: {problem}", file=sys.stderr)
        return 2
    try:
        token = _resolve_token(args)
    except ConfigurationError as exc:
        print(f"remote-tpu-agent: {exc}", file=sys.stderr)
        return 2
    if args.insecure and not args.tls_cert and not is_loopback(args.host):
        log.warning("*** INSECURE: no TLS on %s:%d. The token is required on every call, "
                    "but it, the code and the results travel in clear: anyone who can watch "
                    "this network can read them, and with the token run code as this "
                    "user. ***", args.host, args.port)
    config = AgentConfig(
        host=args.host, port=args.port, advertise=args.advertise_address, slice=found,
        simulate_devices=args.simulate_devices, token=token,
        state_dir=args.state_dir or _default_state_dir(args.port),
        keep_jobs=args.keep_jobs, peer_timeout=args.peer_timeout,
        tpu_lockfile=args.tpu_lockfile, kill_tpu_holders=args.kill_tpu_holders,
        tpu_devices=tuple(d.strip() for d in args.tpu_devices.split(",") if d.strip()),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, mtls=args.mtls,
        pass_env=frozenset(n.strip() for n in args.pass_env.split(",") if n.strip()),
        max_payload_bytes=args.max_payload_bytes, max_streams=args.max_streams,
        max_log_bytes=args.max_log_bytes, max_store_bytes=args.max_store_bytes,
        spare_workers=args.spare_workers, light_spares=args.light_spares,
        cache_bytes=args.cache_bytes,
        compilation_cache_bytes=args.compilation_cache_bytes,
        cache_dir=args.cache_dir, data_port=args.data_port, output_interval=args.output_interval,
        pythons=tuple(args.python), python_downloads=not args.no_python_downloads,
        idle_delete_minutes=args.idle_delete,
        idle_delete_resource=args.idle_delete_resource or "")
    try:
        server, port, service = create_server(config)
    except ConfigurationError as exc:
        print(f"remote-tpu-agent: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"remote-tpu-agent: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return 2
    server.start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1`: where is it?
    stop = threading.Event()
    # CPython runs a Python signal handler only when the main thread wakes; a
    # SIGTERM delivered to one of gRPC's threads leaves an untimed stop.wait()
    # asleep for ever (seen). So the main thread wakes every 0.2 s, and the
    # handler only raises a flag (taking the Event's lock there could deadlock).
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signalled.append(signum))
    if args.exit_with_stdin:
        def watch_stdin() -> None:
            while os.read(0, 4096):
                pass
            stop.set()
        threading.Thread(target=watch_stdin, daemon=True).start()
    print(f"{READY_PREFIX}{args.host}:{port}", flush=True)
    log.info("remote-tpu-agent %s listening on %s:%d (worker %d of %d from %s, advertise %s, "
             "%s, token required)", __version__, args.host, port, found.worker_id,
             max(1, len(found.peers)), found.source, service.parts.address,
             "TLS" + (" + client certificates" if args.mtls else "") if args.tls_cert
             else "no TLS")
    while not signalled and not stop.wait(0.2):
        pass
    log.info("shutting down")
    service.parts.stop_all()
    server.stop(grace=1).wait()
    service.refusals.close()       # no call comes any more: what was counted is said
    return 0
