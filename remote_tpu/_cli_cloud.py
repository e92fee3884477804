"""``remote-tpu up``, ``down`` and ``slices``: slices made and removed on demand
through the Cloud TPU API (``_tpu_api``)."""

from __future__ import annotations

import argparse
import json

RawHelp = argparse.RawDescriptionHelpFormatter

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


def add_parsers(sub: argparse._SubParsersAction) -> None:
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
                           help="ask, and do not wait for the slice to be ACTIVE")
        if name == "slices":
            p.add_argument("--agent-port", type=int, default=8475, metavar="PORT",
                           help="where the agents listen (default 8475)")
            p.add_argument("--json", action="store_true", help="the rows as JSON")
        p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from . import _tpu_api

    if args.command == "up":
        nodes = _tpu_api.up(args.name, args.accelerator, args.zone, args.project,
                            spot=args.spot, reserved=args.reserved,
                            num_slices=args.num_slices, runtime_version=args.runtime_version,
                            wait=not args.no_wait)
        if nodes:
            print(f"ACTIVE: {', '.join(nodes)}. Next, on every worker: install and start the "
                  "agent (docs/deploying.md); then hosts='tpu://"
                  f"{nodes[0]}?zone={args.zone}' reaches it")
    elif args.command == "down":
        _tpu_api.down(args.name, args.zone, args.project)
    else:
        rows = _tpu_api.slices(args.zone, args.project, args.agent_port)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            _tpu_api.print_slices(rows)
    return 0
