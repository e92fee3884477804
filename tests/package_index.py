"""Packages for requirements= tests, with no network: wheels made by hand, and
a package index on 127.0.0.1 that serves them, or that hangs as a server does
which accepts connections and never answers."""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import re
import threading
import zipfile
from collections.abc import Sequence


def make_wheel(directory, name: str, version: str = "1.0", body: str = "ANSWER = 42\n",
               requires: Sequence[str] = ()) -> str:
    """A pure-Python wheel made by hand (no network, no build backend) that
    depends on ``requires`` (requirement strings)."""
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{name}/__init__.py": body,
             f"{info}/METADATA": metadata,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
        record.append(f"{path},sha256={digest.rstrip(b'=').decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = os.path.join(directory, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class PackageIndex:
    """A "simple" package index (PEP 503) at ``url`` serving the wheels in
    ``directory``. Once ``silent`` is set, it accepts each request and never
    answers it, until ``close``."""

    def __init__(self, directory: str, host: str = "127.0.0.1",
                 refuse: Sequence[str] = ()) -> None:
        self.directory = directory
        self.refuse = set(refuse)         # client addresses answered 403 Forbidden
        self.silent = threading.Event()
        self.requests = 0                 # requests received (answered or not)
        self._closing = threading.Event()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                index.requests += 1
                if index.silent.is_set():
                    index._closing.wait()
                    return
                status, body = ((403, b"") if self.client_address[0] in index.refuse
                                else index._answer(self.path))
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream"
                                 if self.path.startswith("/files/") else "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}/simple"
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="package-index").start()

    def _answer(self, path: str) -> tuple[int, bytes]:
        wheels = sorted(os.listdir(self.directory))
        if path.startswith("/files/") and path[7:] in wheels:
            with open(os.path.join(self.directory, path[7:]), "rb") as f:
                return 200, f.read()
        m = re.fullmatch(r"/simple/([^/]+)/?", path)
        if not m:
            return 404, b""
        links = [f'<a href="/files/{w}">{w}</a>' for w in wheels
                 if _normalized(w.split("-")[0]) == _normalized(m.group(1))]
        return (200, ("<html><body>" + "".join(links) + "</body></html>").encode()) \
            if links else (404, b"")

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
