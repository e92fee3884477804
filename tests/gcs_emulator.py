"""A real Google Cloud Storage emulator (PyPI ``gcp-storage-emulator``) run as a
subprocess on loopback. Use: ``from gcs_emulator import gcs`` (a module fixture that
also points this process and the agents its tests start at it),
``gcs.make_bucket("data")``, ``gcs.client()``, ``env={**os.environ, **gcs.env()}``.

Checked against it with google-cloud-storage 3.x:
  * upload_from_string / upload_from_filename (small, and 10 MiB resumable with
    ``blob.chunk_size = 1 << 20``), download_to_filename / download_as_bytes,
    ``client.list_blobs(bucket, prefix=...)``, exists(), blob and bucket delete.
  * A missing bucket or object raises ``google.api_core.exceptions.NotFound``
    (get_bucket, list_blobs, upload into a missing bucket, downloads, delete);
    a failed download_to_filename leaves no file; exists() answers False. A
    duplicate bucket, or deleting a non-empty bucket without ``force=True``,
    raises ``google.api_core.exceptions.Conflict``.
  * A fresh subprocess with only ``env()`` (no credentials file or gcloud config)
    can use ``storage.Client()`` with no arguments: STORAGE_EMULATOR_HOST alone
    makes the library use anonymous credentials; GOOGLE_CLOUD_PROJECT only sets
    ``client.project`` (else None, which this emulator does not mind).
Limitations: data in memory only; one request at a time; plain HTTP; no auth.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

PROJECT = "test-project"


def _free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _emulator_command() -> list[str]:
    """The emulator's console script next to this Python, else ``python -m``."""
    script = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "gcp_storage_emulator"]


class GcsEmulator:
    """Starts the emulator on entry (or ``start()``), stops it on exit (``stop()``)."""

    def __init__(self, startup_timeout: float = 20.0) -> None:
        self.port = _free_port()
        self.host = f"http://127.0.0.1:{self.port}"   # the STORAGE_EMULATOR_HOST value
        self._timeout = startup_timeout
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()          # the emulator's stdout + stderr

    def start(self) -> GcsEmulator:
        # --in-memory: no files are written; --quiet: log only critical problems.
        self._proc = subprocess.Popen(
            _emulator_command() + ["start", "--host", "127.0.0.1", "--port",
                                   str(self.port), "--in-memory", "--quiet"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._timeout
        while True:
            try:   # "GET /" is the emulator's health check; it answers "OK".
                with urllib.request.urlopen(self.host + "/", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:                           # not listening yet
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                output = self._log.read().decode(errors="replace")
                self.stop()
                raise RuntimeError(f"GCS emulator did not answer at {self.host} "
                                   f"within {self._timeout}s (exit code "
                                   f"{self._proc.returncode}); its output:\n{output}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Terminate the emulator, killing it if it is still alive after 5 s."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    __enter__ = start

    def __exit__(self, *exc_info) -> None:
        self.stop()                                   # whether or not the body raised

    def env(self) -> dict[str, str]:
        """Variables that point ``storage.Client()`` in another process here."""
        return {"STORAGE_EMULATOR_HOST": self.host, "GOOGLE_CLOUD_PROJECT": PROJECT}

    def client(self):
        """A ``google.cloud.storage.Client`` on this emulator; no credentials needed."""
        from google.auth.credentials import AnonymousCredentials  # imported here: not
        from google.cloud import storage  # every test that imports this module needs it
        return storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.host})

    def make_bucket(self, name: str):
        """Create the bucket ``name`` and return it (a ``storage.Bucket``)."""
        return self.client().create_bucket(name)


@pytest.fixture(scope="module")
def gcs():
    """A running emulator that this process, and the agents it starts, use
    (its variables set in os.environ while the module's tests run)."""
    with GcsEmulator() as emulator:
        saved = {k: os.environ.get(k) for k in emulator.env()}
        os.environ.update(emulator.env())
        try:
            yield emulator
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
