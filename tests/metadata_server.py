"""A stand-in for the GCE metadata server of one TPU VM: a real HTTP server on
loopback that answers like the real one (it demands ``Metadata-Flavor: Google``
and says so in every answer; unknown keys are 404)."""

from __future__ import annotations

import http.server
import threading
import time


class MetadataStandIn:
    def __init__(self, attributes: dict[str, str], *, delay: float = 0.0,
                 flavor_header: bool = True) -> None:
        self.attributes = dict(attributes)
        self.instance = {"preempted": "FALSE"}     # instance/<key>, besides attributes
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                flavor = self.headers.get("Metadata-Flavor")
                outer.requests.append((self.path, flavor))
                time.sleep(delay)
                if flavor != "Google":
                    return self._send(403, "Missing required header: Metadata-Flavor\n")
                prefix = "/computeMetadata/v1/instance/"
                key = self.path[len(prefix):] if self.path.startswith(prefix) else ""
                if key.startswith("attributes/"):
                    value = outer.attributes.get(key.removeprefix("attributes/"))
                else:
                    value = outer.instance.get(key)
                if value is None:
                    return self._send(404, "not found\n")
                return self._send(200, value)

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                if flavor_header:
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tpu_vm(worker: int, hosts: list[str], accelerator: str, **kw) -> MetadataStandIn:
    """What a TPU VM's metadata server says about worker ``worker``."""
    return MetadataStandIn({
        "agent-worker-number": str(worker),
        "worker-network-endpoints": ",".join(f"w-{i}:{i}:{h}" for i, h in enumerate(hosts)),
        "accelerator-type": accelerator,
        "tpu-env": f"ACCELERATOR_TYPE: '{accelerator}'\nWORKER_ID: '{worker}'\n",
    }, **kw)
