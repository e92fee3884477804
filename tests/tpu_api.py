"""A stand-in for the Cloud TPU API (v2) as a real HTTP server on loopback: queued
resources (create, get, list, delete with force), nodes (get, list, delete) and
long-running operations, answering what Google's google-cloud-tpu library sends
over its REST transport. A queued resource waits ``waits`` looks (gets) in
WAITING_FOR_RESOURCES, then PROVISIONING, then is ACTIVE with its nodes (workers
at ``ips``), or FAILED with ``fail`` as its reason.

``bearer``: a call must carry ``Authorization: Bearer <bearer>`` (else 401), as a
VM's own token from its metadata server; ``forbid``: every DELETE is answered
403 with it as the message, as for a service account without the role."""

from __future__ import annotations

import http.server
import itertools
import json
import threading
import time
import urllib.parse

QR_TYPE = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"


class CloudTpuStandIn:
    def __init__(self, ips: list[str], waits: int = 2, fail: str = "") -> None:
        self.ips, self.waits, self.fail = ips, waits, fail
        self.bearer: str | None = None
        self.deletes: list[float] = []        # when each DELETE came (time.monotonic())
        self.forbid = ""
        self.resources: dict[str, dict] = {}      # full name -> QueuedResource JSON
        self.nodes: dict[str, dict] = {}          # full name -> Node JSON
        self.looks: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict]] = []    # (method, path, body)
        self._ops = itertools.count(1)
        self._lock = threading.Lock()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                with stand_in._lock:
                    stand_in.requests.append((method, url.path, body))
                    if method == "DELETE":
                        stand_in.deletes.append(time.monotonic())
                    code, reply = stand_in._refusal(method, self.headers.get("Authorization"))
                    if not code:
                        code, reply = stand_in._route(method, url.path.removeprefix("/v2/"),
                                                      query, body)
                data = json.dumps(reply).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                self._answer("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._answer("POST")

            def do_DELETE(self) -> None:  # noqa: N802
                self._answer("DELETE")

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_queued_resource(self, parent: str, name: str, accelerator: str) -> str:
        """An ACTIVE queued resource with its one node, as `up` leaves it: its name."""
        full = f"{parent}/queuedResources/{name}"
        self.resources[full] = {"name": full, "state": {"state": "ACTIVE"}, "tpu": {
            "nodeSpec": [{"parent": parent, "nodeId": name,
                          "node": {"acceleratorType": accelerator}}]}}
        self.looks[full] = 0
        self.add_node(parent, name, accelerator)
        return full

    def add_node(self, parent: str, node_id: str, accelerator: str) -> None:
        """A node made by hand, with no queued resource."""
        self.nodes[f"{parent}/nodes/{node_id}"] = self._node(parent, node_id, accelerator)

    # ------------------------------------------------------------------ routes

    def _refusal(self, method: str, authorization: str | None) -> tuple[int, dict]:
        """(0, {}) for a call let through; else its 401 or 403."""
        if self.bearer is not None and authorization != f"Bearer {self.bearer}":
            return _error(401, "UNAUTHENTICATED", "Request had invalid authentication "
                          "credentials. Expected OAuth 2 access token.")
        if method == "DELETE" and self.forbid:
            return _error(403, "PERMISSION_DENIED", self.forbid)
        return 0, {}

    def _route(self, method: str, path: str, query: dict, body: dict) -> tuple[int, dict]:
        parts = path.split("/")
        if len(parts) < 5 or parts[0] != "projects" or parts[2] != "locations":
            return _error(404, "NOT_FOUND", f"no such resource {path}")
        parent, kind, rest = "/".join(parts[:4]), parts[4], parts[5:]
        if kind == "queuedResources":
            return self._queued(method, parent, rest, query, body)
        if kind == "nodes":
            return self._nodes(method, parent, rest)
        if kind == "operations":
            return _error(404, "NOT_FOUND", "operations are answered done at once here")
        return _error(404, "NOT_FOUND", f"no such collection {kind}")

    def _queued(self, method, parent, rest, query, body) -> tuple[int, dict]:
        if method == "POST" and not rest:
            name = f"{parent}/queuedResources/{query.get('queuedResourceId', '')}"
            if name in self.resources:
                return _error(409, "ALREADY_EXISTS", f"{name} already exists")
            resource = {**body, "name": name, "state": {"state": "WAITING_FOR_RESOURCES"}}
            self.resources[name] = resource
            self.looks[name] = 0
            return 200, self._done(parent, {"@type": QR_TYPE, **resource})
        if method == "GET" and not rest:
            return 200, {"queuedResources": list(self.resources.values())}
        name = f"{parent}/queuedResources/{rest[0]}"
        resource = self.resources.get(name)
        if resource is None:
            return _error(404, "NOT_FOUND", f"{name} not found")
        if method == "GET":
            self._advance(parent, name, resource)
            return 200, resource
        if method == "DELETE":
            mine = [n for n in self._node_names(parent, resource) if n in self.nodes]
            if mine and query.get("force") != "true":
                return _error(400, "FAILED_PRECONDITION",
                              f"{name} has nodes: delete them first, or use force")
            for n in mine:
                del self.nodes[n]
            del self.resources[name]
            return 200, self._done(parent, {"@type": EMPTY_TYPE})
        return _error(405, "UNIMPLEMENTED", method)

    def _nodes(self, method, parent, rest) -> tuple[int, dict]:
        if method == "GET" and not rest:
            return 200, {"nodes": [n for k, n in self.nodes.items() if k.startswith(parent)]}
        name = f"{parent}/nodes/{rest[0]}"
        if name not in self.nodes:
            return _error(404, "NOT_FOUND", f"{name} not found")
        if method == "GET":
            return 200, self.nodes[name]
        if method == "DELETE":
            del self.nodes[name]
            return 200, self._done(parent, {"@type": EMPTY_TYPE})
        return _error(405, "UNIMPLEMENTED", method)

    # ------------------------------------------------------------------ helpers

    def _advance(self, parent: str, name: str, resource: dict) -> None:
        """Each look takes the request a step further."""
        self.looks[name] += 1
        state = resource["state"]["state"]
        if state not in ("WAITING_FOR_RESOURCES", "PROVISIONING"):
            return
        if self.looks[name] < self.waits:
            return
        if self.fail:
            resource["state"] = {"state": "FAILED",
                                 "failedData": {"error": {"code": 8, "message": self.fail}}}
        elif state == "WAITING_FOR_RESOURCES":
            resource["state"] = {"state": "PROVISIONING"}
        else:
            spec = resource["tpu"]["nodeSpec"][0]
            for node_id in self._node_ids(resource):
                self.nodes[f"{parent}/nodes/{node_id}"] = self._node(
                    parent, node_id, spec["node"].get("acceleratorType", ""))
            resource["state"] = {"state": "ACTIVE"}

    @staticmethod
    def _node_ids(resource: dict) -> list[str]:
        spec = resource["tpu"]["nodeSpec"][0]
        if "nodeId" in spec:
            return [spec["nodeId"]]
        multi = spec.get("multisliceParams", {})
        prefix = multi.get("nodeIdPrefix") or resource["name"].rsplit("/", 1)[1]
        return [f"{prefix}-{i}" for i in range(int(multi.get("nodeCount", 1)))]

    def _node_names(self, parent: str, resource: dict) -> list[str]:
        return [f"{parent}/nodes/{i}" for i in self._node_ids(resource)]

    def _node(self, parent: str, node_id: str, accelerator: str) -> dict:
        return {"name": f"{parent}/nodes/{node_id}", "acceleratorType": accelerator,
                "state": "READY", "runtimeVersion": "tpu-ubuntu2204-base",
                "networkEndpoints": [{"ipAddress": ip, "port": 8470} for ip in self.ips]}

    def _done(self, parent: str, response: dict) -> dict:
        return {"name": f"{parent}/operations/op-{next(self._ops)}", "done": True,
                "response": response}


def _error(code: int, status: str, message: str) -> tuple[int, dict]:
    return code, {"error": {"code": code, "message": message, "status": status}}
