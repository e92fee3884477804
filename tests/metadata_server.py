"""Stand-ins for Google's HTTP services, as real HTTP servers on loopback: the
GCE metadata server of one TPU VM (and slices of them), and the Cloud TPU API."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

# (path, request headers) -> (status, response headers, body)
Respond = Callable[[str, dict[str, str]], tuple[int, dict[str, str], bytes]]


class HttpStandIn:
    """A real HTTP server answering GETs with ``respond`` (on ``host``,
    ``port``; a subclass may answer by the caller's address: ``answer``)."""

    def __init__(self, respond: Respond | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self._respond_fn = respond
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                code, headers, body = stand_in.answer(self.client_address[0], self.path,
                                                      dict(self.headers))
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.address = f"{host}:{self.server.server_address[1]}"
        self.url = f"http://{self.address}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, client: str, path: str, headers: dict[str, str]) -> tuple[int, dict, bytes]:
        return self._respond_fn(path, headers)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AgentsOnAddresses:
    """Agents on ``ips`` (loopback addresses), one port, each with an
    environment of its own on top of ``base`` (default: this one's)."""

    def __init__(self, ips: list[str], envs: list[dict[str, str]], *, token: str | None = None,
                 port: int = 0, extra: list[str] | None = None, prefix: str = "agents-",
                 base: dict[str, str] | None = None) -> None:
        from conftest import free_port
        from remote_tpu._core.auth import TOKEN_ENV, new_token

        self.token = token or new_token()
        self.port = port or free_port()
        self.ips = ips
        self.addresses = [f"{ip}:{self.port}" for ip in ips]
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.procs = []
        for i, ip in enumerate(ips):
            env = {**(os.environ if base is None else base), TOKEN_ENV: self.token, **envs[i]}
            cmd = [sys.executable, "-m", "remote_tpu_agent", "--host", ip, "--port",
                   str(self.port), "--simulate-devices", "2", "--log-level", "WARNING",
                   "--state-dir", os.path.join(self.dir, f"state-{i}"), *(extra or [])]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.DEVNULL, text=True, env=env))
        for proc in self.procs:
            assert proc.stdout.readline().startswith("remote-tpu-agent listening on")

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(10)
            proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class MetadataStandIn(HttpStandIn):
    """The metadata server of one TPU VM: it demands ``Metadata-Flavor: Google``
    and says so in every answer; unknown keys are 404."""

    def __init__(self, attributes: dict[str, str], *, delay: float = 0.0,
                 flavor_header: bool = True) -> None:
        self.attributes = dict(attributes)
        self.instance = {"preempted": "FALSE"}     # instance/<key>, besides attributes
        self.requests: list[tuple[str, str | None]] = []
        self._delay = delay
        self._flavor = {"Metadata-Flavor": "Google"} if flavor_header else {}
        super().__init__(self._respond)

    def service_account(self, token: str, scopes: list[str]) -> None:
        """The VM's default service account: its access token (the JSON the
        metadata server answers) and its scopes (one a line)."""
        self.instance["service-accounts/default/token"] = json.dumps(
            {"access_token": token, "expires_in": 3599, "token_type": "Bearer"})
        self.instance["service-accounts/default/scopes"] = "\n".join(scopes)

    def _respond(self, path: str, headers: dict[str, str]) -> tuple[int, dict, bytes]:
        flavor = headers.get("Metadata-Flavor")
        self.requests.append((path, flavor))
        time.sleep(self._delay)
        reply = {**self._flavor, "Content-Type": "application/text"}
        if flavor != "Google":
            return 403, reply, b"Missing required header: Metadata-Flavor\n"
        prefix = "/computeMetadata/v1/instance/"
        key = path[len(prefix):] if path.startswith(prefix) else ""
        if key.startswith("attributes/"):
            value = self.attributes.get(key.removeprefix("attributes/"))
        else:
            value = self.instance.get(key)
        if value is None:
            return 404, reply, b"not found\n"
        return 200, reply, value.encode()


def tpu_vm(worker: int, hosts: list[str], accelerator: str, tpu_env: str = "",
           **kw) -> MetadataStandIn:
    """What a TPU VM's metadata server says about worker ``worker``
    (``tpu_env``: more lines of its tpu-env, ``KEY: 'value'``)."""
    return MetadataStandIn({
        "agent-worker-number": str(worker),
        "worker-network-endpoints": ",".join(f"w-{i}:{i}:{h}" for i, h in enumerate(hosts)),
        "accelerator-type": accelerator,
        "tpu-env": f"ACCELERATOR_TYPE: '{accelerator}'\nWORKER_ID: '{worker}'\n{tpu_env}",
    }, **kw)


def multislice_env(slice_id: int, coordinator: str, num: int = 2) -> str:
    """The lines a multislice queued resource adds to a VM's tpu-env."""
    return (f"MEGASCALE_NUM_SLICES: '{num}'\nMEGASCALE_SLICE_ID: '{slice_id}'\n"
            f"MEGASCALE_COORDINATOR_ADDRESS: '{coordinator}:8080'\n")


class MetadataSlice(AgentsOnAddresses):
    """Agents on 127.0.0.2, 127.0.0.3, ... (``first_ip`` = 2; one port, like
    TPU VMs), each told who it is only by its own metadata stand-in."""

    def __init__(self, accelerator: str, n: int, extra: list[str] | None = None, *,
                 first_ip: int = 2, tpu_env: str = "", token: str | None = None,
                 port: int = 0) -> None:
        ips = [f"127.0.0.{first_ip + i}" for i in range(n)]
        self.servers = [tpu_vm(i, ips, accelerator, tpu_env) for i in range(n)]
        super().__init__(ips, [{"GCE_METADATA_IP": s.address} for s in self.servers],
                         token=token, port=port, extra=extra, prefix="tpu-vm-")

    def stop(self) -> None:
        super().stop()
        for server in self.servers:
            server.close()


class TpuApiStandIn(HttpStandIn):
    """A stand-in for the Cloud TPU API's nodes.get (v2), a real HTTP server."""

    def __init__(self, nodes: dict[str, dict]) -> None:
        self.nodes = nodes

        def respond(path: str, headers: dict[str, str]) -> tuple[int, dict, bytes]:
            node = self.nodes.get(path.removeprefix("/v2/"))
            body = json.dumps(node if node else {"error": {"code": 404}}).encode()
            return (200 if node else 404), {"Content-Type": "application/json"}, body

        super().__init__(respond)


def tpu_node(ips: list[str], accelerator: str, state: str = "READY") -> dict:
    return {"acceleratorType": accelerator, "state": state,
            "networkEndpoints": [{"ipAddress": ip, "port": 8470,
                                  "accessConfig": {"externalIp": f"34.0.0.{i}"}}
                                 for i, ip in enumerate(ips)]}
