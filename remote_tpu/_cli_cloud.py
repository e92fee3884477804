"""``remote-tpu setup`` (agents onto a slice's hosts, over SSH: ``_setup``),
and ``up``, ``down`` and ``slices``: slices made and removed on demand through
the Cloud TPU API (``_tpu_api``)."""

from __future__ import annotations

import argparse
import json

RawHelp = argparse.RawDescriptionHelpFormatter

SETUP = ("make every host of a slice ready and start its agent, over SSH: Python, "
         "this client's remote-tpu, jax, the token, the service", """examples:
  remote-tpu setup tpu://my-slice?zone=us-east5-a          a TPU VM slice, by name
  remote-tpu setup me@10.0.0.2 me@10.0.0.3 me@10.0.0.4 me@10.0.0.5   hosts in worker order
  remote-tpu setup tpu://my-slice?zone=us-east5-a --agent-args "--tls-cert c.pem --tls-key k.pem"

Running it again is safe: it redoes only what differs (a new client version,
token or flags); an unchanged host is left as it is.""")

COMMANDS = {
    "up": ("make a slice: a queued resource through the Cloud TPU API, shown while it "
           "waits for capacity", """examples:
  remote-tpu up my-slice --accelerator tpu-v5p-32 --zone us-east5-a
  remote-tpu up my-slice --accelerator tpu-v5litepod-16 --zone us-west4-a --spot
  remote-tpu up big --accelerator tpu-v5p-128 --zone us-east5-a --num-slices 2 --reserved"""),
    "down": ("delete a slice: its queued resource and its nodes (or a node made by hand)",
             """examples:
  remote-tpu down my-slice --zone us-east5-a
  remote-tpu down my-slice --zone us-east5-a --project my-project"""),
    "slices": ("a zone's slices: queued resources and nodes, their state, and whether an "
               "agent answers", """examples:
  remote-tpu slices --zone us-east5-a
  remote-tpu slices --zone us-east5-a --json | jq -r '.[].node'"""),
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zone", required=True, help="the zone, e.g. us-east5-a")
    p.add_argument("--project", default="", help="the project (default: the credentials' "
                                                 "or $GOOGLE_CLOUD_PROJECT)")


def _setup_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", default="", help="the SSH user where an address names none "
                                              "(default: ssh's; for tpu://, yours, as gcloud)")
    p.add_argument("--identity-file", default="", metavar="KEY",
                   help="the SSH key (default: ssh's; for tpu://, gcloud's "
                        "~/.ssh/google_compute_engine)")
    p.add_argument("-o", "--ssh-option", action="append", default=[], metavar="OPTION",
                   help="an ssh -o option, e.g. -o ProxyJump=bastion (repeatable)")
    p.add_argument("--agent-port", type=int, default=8475, metavar="PORT",
                   help="the port the agents listen on (default 8475)")
    p.add_argument("--dir", default="~/.local/share/remote-tpu", metavar="DIR",
                   help="where on each host the agent's Python environment goes "
                        "(default ~/.local/share/remote-tpu)")
    p.add_argument("--pip-index", default="", metavar="URL",
                   help="the package index the hosts install from (default: theirs)")
    p.add_argument("--agent-args", default="", metavar="FLAGS",
                   help="more remote-tpu-agent flags for every agent, e.g. "
                        "\"--tls-cert c.pem --tls-key k.pem\"")
    p.add_argument("--internal-ip", action="store_true",
                   help="for tpu://, reach the workers at their internal IPs (from inside "
                        "the VPC; default: external where they have one, as gcloud does)")
    p.add_argument("--token-file", default="", metavar="PATH",
                   help="the slice token to give the agents (default: the one this "
                        "client sends: $REMOTE_TPU_TOKEN, $REMOTE_TPU_TOKEN_FILE or "
                        "~/.config/remote_tpu/token, made if none)")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help=SETUP[0], description=SETUP[0], epilog=SETUP[1],
                       formatter_class=RawHelp)
    p.add_argument("hosts", nargs="+", metavar="HOST",
                   help="tpu://NAME?zone=ZONE[&project=P], or the hosts' SSH addresses "
                        "([USER@]HOST[:PORT]) in worker order")
    _setup_flags(p)
    p.set_defaults(func=run_setup)
    for name, (text, epilog) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, epilog=epilog,
                           formatter_class=RawHelp)
        if name != "slices":
            p.add_argument("name", help="the slice's name (its queued resource's and node's)")
        _common(p)
        if name == "up":
            p.add_argument("--accelerator", required=True, help="e.g. tpu-v5p-32")
            tier = p.add_mutually_exclusive_group()
            tier.add_argument("--spot", action="store_true", help="spot capacity (cheaper; "
                                                                  "may be taken back)")
            tier.add_argument("--reserved", action="store_true",
                              help="the project's reserved capacity")
            p.add_argument("--num-slices", type=int, default=1, metavar="N",
                           help="N slices of the accelerator, one multislice job's (default 1)")
            p.add_argument("--runtime-version", default="", metavar="IMAGE",
                           help="the TPU VM image (default: the generation's base image)")
            p.add_argument("--no-wait", action="store_true",
                           help="ask, and do not wait for the slice to be ACTIVE (nor set "
                                "it up)")
            p.add_argument("--no-setup", action="store_true",
                           help="once ACTIVE, do not run `remote-tpu setup` on it")
            p.add_argument("--idle-delete", type=float, default=0, metavar="MINUTES",
                           help="delete the slice once idle this long (its agents do, with "
                                "the VMs' service account, given the cloud-platform scope)")
            _setup_flags(p)
        if name == "slices":
            p.add_argument("--agent-port", type=int, default=8475, metavar="PORT",
                           help="where the agents listen (default 8475)")
            p.add_argument("--json", action="store_true", help="the rows as JSON")
        p.set_defaults(func=run)


def run_setup(args: argparse.Namespace, hosts: list[str] | None = None) -> int:
    from . import _setup

    _setup.main(hosts or args.hosts, user=args.user, identity_file=args.identity_file,
                ssh_options=args.ssh_option, port=args.agent_port, directory=args.dir,
                pip_index=args.pip_index, agent_args=args.agent_args,
                token_file=args.token_file, internal_ip=args.internal_ip,
                say=lambda line: print(line, flush=True))
    return 0


def _unset(left: list[str], where: str, idle: str, args: argparse.Namespace) -> str:
    """What a setup that failed after ``up`` leaves, and what to do."""
    again = f"remote-tpu setup 'tpu://NODE?{where}'"
    if idle:
        again += f" (for {left[0]} if it is slice 0, with --agent-args {idle!r})"
    return (f"The slice stands, and is billed, with no agents set up on {', '.join(left)}"
            f"{' and nothing to delete it when idle' if idle else ''}: run {again} for each, "
            f"or `remote-tpu down {args.name} --zone {args.zone}` to delete it.")


def _idle_delete_flags(args: argparse.Namespace) -> str:
    """The agent flags ``up --idle-delete`` gives slice 0's agents ("" without it)."""
    import shlex

    from ._core.exceptions import ConfigurationError

    if not args.idle_delete:
        return ""
    if not 0 < args.idle_delete <= 10080:
        raise ConfigurationError(f"--idle-delete {args.idle_delete:g}: give minutes above 0, "
                                 "up to 10080 (a week)")
    if args.no_setup or args.no_wait:
        raise ConfigurationError("--idle-delete is carried out by the slice's agents, which "
                                 "setup starts: drop --no-setup/--no-wait, or give the agents "
                                 "--idle-delete yourself (docs/deploying.md)")
    from ._tpu_api import queued_resource

    return shlex.join(["--idle-delete", f"{args.idle_delete:g}", "--idle-delete-resource",
                       queued_resource(args.name, args.zone, args.project)])


def run(args: argparse.Namespace) -> int:
    from . import _tpu_api
    from ._core.exceptions import RemoteTPUError

    if args.command == "up":
        idle = _idle_delete_flags(args)
        nodes = _tpu_api.up(args.name, args.accelerator, args.zone, args.project,
                            spot=args.spot, reserved=args.reserved,
                            num_slices=args.num_slices, runtime_version=args.runtime_version,
                            wait=not args.no_wait, cloud_scope=bool(idle))
        where = f"zone={args.zone}" + (f"&project={args.project}" if args.project else "")
        if nodes and args.no_setup:
            print(f"ACTIVE: {', '.join(nodes)}. Next: remote-tpu setup "
                  f"'tpu://{nodes[0]}?{where}' (each node) installs and starts the agents; "
                  f"then hosts='tpu://{nodes[0]}?{where}' reaches it")
        elif nodes:
            print(f"ACTIVE: {', '.join(nodes)}. Setting up the agents...", flush=True)
            agent_args = args.agent_args
            for i, node in enumerate(nodes):
                # Slice 0's gateway runs every job of a multislice: it alone decides.
                args.agent_args = f"{agent_args} {idle}" if idle and i == 0 else agent_args
                try:
                    run_setup(args, [f"tpu://{node}?{where}"])
                except RemoteTPUError as exc:
                    raise RemoteTPUError(f"{exc}\n\n{_unset(nodes[i:], where, idle, args)}") \
                        from None
    elif args.command == "down":
        _tpu_api.down(args.name, args.zone, args.project)
    else:
        rows = _tpu_api.slices(args.zone, args.project, args.agent_port)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            _tpu_api.print_slices(rows)
    return 0
