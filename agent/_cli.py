"""`remote-tpu-agent`: the daemon's entry point. The only place that configures logging."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from remote_tpu._version import __version__

from ._discovery import Slice
from ._server import AgentConfig, create_server

log = logging.getLogger("remote_tpu_agent")
READY_PREFIX = "remote-tpu-agent listening on "


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="remote-tpu-agent",
        description="Serve remote_tpu jobs on this host (one agent per TPU VM).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8475,
                   help="port to listen on; 0 picks a free one (default 8475)")
    p.add_argument("--advertise-address", default="",
                   help="address peers reach this host at (default: --host, or this "
                        "machine's hostname address when listening on all interfaces)")
    p.add_argument("--worker-id", type=int, default=0,
                   help="this host's index in the slice (0 = gateway)")
    p.add_argument("--peers", default="",
                   help="comma-separated agent addresses of every host, index = worker id")
    p.add_argument("--simulate-devices", type=int, default=0, metavar="K",
                   help="run JAX on CPU with K devices per process (local slice, tests)")
    p.add_argument("--state-dir", default="",
                   help="directory for job files (default: a fresh temporary directory)")
    p.add_argument("--exit-with-stdin", action="store_true",
                   help="shut down when standard input closes (the local slice uses this "
                        "so agents never outlive their client)")
    p.add_argument("--log-level", default=os.environ.get("REMOTE_TPU_AGENT_LOG", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--version", action="version", version=f"remote-tpu-agent {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.simulate_devices < 0:
        _parser().error("--simulate-devices must be >= 0")
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    config = AgentConfig(host=args.host, port=args.port, advertise=args.advertise_address,
                         slice=Slice(worker_id=args.worker_id, peers=peers),
                         simulate_devices=args.simulate_devices, state_dir=args.state_dir)
    try:
        server, port, service = create_server(config)
    except (OSError, RuntimeError) as exc:
        print(f"remote-tpu-agent: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return 2
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_with_stdin:
        def watch_stdin() -> None:
            while os.read(0, 4096):
                pass
            stop.set()
        threading.Thread(target=watch_stdin, daemon=True).start()
    print(f"{READY_PREFIX}{args.host}:{port}", flush=True)
    log.info("remote-tpu-agent %s listening on %s:%d (worker %d, advertise %s)",
             __version__, args.host, port, args.worker_id, service.address)
    stop.wait()
    log.info("shutting down")
    service.stop_all()
    server.stop(grace=1).wait()
    return 0
