"""``remote-tpu gke manifest``: a JobSet that runs the agent on every VM of a
TPU slice on GKE, and the agent image's Dockerfile (``_gke``)."""

from __future__ import annotations

import argparse

from ._core.addresses import DEFAULT_AGENT_PORT

RawHelp = argparse.RawDescriptionHelpFormatter

GKE_TEXT = "run the agents on GKE: the manifest and the agent image"
GKE_EPILOG = """examples:
  remote-tpu gke manifest --accelerator tpu-v6e-16 --out gke/
  remote-tpu gke manifest --accelerator tpu7x-32 --image REGISTRY/remote-tpu-agent:0.1.0

each step: docs/deploying.md (GKE)"""
MANIFEST_TEXT = ("write a JobSet running one agent per TPU VM (one replicated job per "
                 "slice), a Service per slice in front of its worker 0, and the agent "
                 "image's Dockerfile")
MANIFEST_EPILOG = """examples:
  remote-tpu gke manifest --accelerator tpu-v5p-32 > jobset.json
  remote-tpu gke manifest --accelerator tpu-v6e-16 --num-slices 2 --queue team-a --out gke/
  remote-tpu gke manifest --accelerator tpu7x-32 --name ironwood --image REGISTRY/agent:0.1.0 \\
      --out gke/ && kubectl apply -f gke/jobset.json"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    gke = sub.add_parser("gke", help=GKE_TEXT, description=GKE_TEXT, epilog=GKE_EPILOG,
                         formatter_class=RawHelp)
    actions = gke.add_subparsers(dest="gke_action", metavar="ACTION")
    p = actions.add_parser("manifest", help=MANIFEST_TEXT, description=MANIFEST_TEXT,
                           epilog=MANIFEST_EPILOG, formatter_class=RawHelp)
    p.add_argument("--accelerator", required=True,
                   help="the slice, e.g. tpu-v5p-32, tpu-v6e-16, tpu7x-32")
    p.add_argument("--name", default="remote-tpu",
                   help="the JobSet's name; pods are NAME-slice-I-J (default remote-tpu)")
    p.add_argument("--num-slices", type=int, default=1, metavar="N",
                   help="N slices of the accelerator, one multislice (default 1)")
    p.add_argument("--image", default="",
                   help="the agent image built from the Dockerfile (default "
                        "remote-tpu-agent:VERSION)")
    p.add_argument("--queue", default="",
                   help="a Kueue LocalQueue to admit the JobSet (kueue.x-k8s.io/queue-name)")
    p.add_argument("--port", type=int, default=DEFAULT_AGENT_PORT,
                   help=f"the agents' port (default {DEFAULT_AGENT_PORT})")
    p.add_argument("--token-secret", default="remote-tpu-token",
                   help="the Secret holding the slice token under the key 'token' "
                        "(default remote-tpu-token)")
    p.add_argument("--out", default="", metavar="DIR",
                   help="write DIR/jobset.json, and DIR/Dockerfile with the wheel of this "
                        "client's remote-tpu it installs (default: the manifest on stdout)")
    gke.set_defaults(func=run, gke_parser=gke)


def run(args: argparse.Namespace) -> int:
    from . import _gke

    if args.gke_action is None:
        args.gke_parser.error("give what to do: manifest (`remote-tpu gke manifest --help`)")
    objects = _gke.manifest(args.accelerator, name=args.name, num_slices=args.num_slices,
                            image=args.image, queue=args.queue, port=args.port,
                            token_secret=args.token_secret)
    if not args.out:
        print(_gke.to_json(objects), end="")
        return 0
    paths = _gke.write(args.out, objects, args.port)
    print(f"wrote {', '.join(paths)}. Next: build and push the image, make the token "
          f"Secret {args.token_secret!r}, kubectl apply -f {paths[0]}; then "
          f"kubectl port-forward service/{_gke.gateway_service(args.name)} "
          f"{args.port}:{args.port} and hosts='127.0.0.1:{args.port}' reaches worker 0")
    return 0
