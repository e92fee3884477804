"""``hosts="tpu://NAME?zone=Z&project=P"``: a TPU VM slice by name, resolved to
its workers' agent addresses through the Cloud TPU API (v2, ``nodes.get``).

Needs google-auth (``pip install remote-tpu[gcp]``) and application default
credentials (``gcloud auth application-default login``). Query options:
``zone`` (required), ``project`` (default: the credentials' project),
``port`` (the agents' port, default 8475), ``external=1`` (use the workers'
external IPs, for a client outside the VPC). ``REMOTE_TPU_TPU_API`` points at
another endpoint than https://tpu.googleapis.com (a test stand-in, say).
"""

from __future__ import annotations

import os

from ._core.exceptions import ConfigurationError
from ._core.addresses import TpuRef, join_host_port

API_ENV = "REMOTE_TPU_TPU_API"
_DEFAULT_API = "https://tpu.googleapis.com"


def credentials_and_project(project: str, *, needs: str, no_project: str):
    """Google credentials (anonymous ones for a local stand-in at
    ``REMOTE_TPU_TPU_API``) and the project: ``project``, else the
    credentials' own, else ``$GOOGLE_CLOUD_PROJECT``. ``needs``: who needs
    them, as the errors say; ``no_project``: the error without a project."""
    try:
        import google.auth
        import google.auth.exceptions
        from google.auth.credentials import AnonymousCredentials
    except ImportError:
        raise ConfigurationError(f"{needs} needs google-auth: "
                                 "pip install 'remote-tpu[gcp]'") from None
    if os.environ.get(API_ENV, "").startswith("http://127."):
        # A local stand-in: no credentials to find (looking for them can take
        # Google's library seconds of probing for a metadata server).
        credentials, default_project = AnonymousCredentials(), ""
    else:
        try:
            credentials, default_project = google.auth.default(
                scopes=["https://www.googleapis.com/auth/cloud-platform"])
        except google.auth.exceptions.DefaultCredentialsError as exc:
            raise ConfigurationError(
                f"{needs} needs Google credentials to ask the Cloud TPU API: "
                f"run `gcloud auth application-default login` ({exc})") from None
    project = project or default_project or os.environ.get("GOOGLE_CLOUD_PROJECT", "")
    if not project:
        raise ConfigurationError(no_project)
    return credentials, project


def _session_and_project(project: str):
    credentials, project = credentials_and_project(
        project, needs="hosts='tpu://...'",
        no_project="hosts='tpu://NAME?zone=...': add &project=PROJECT (no default project "
                   "in the credentials)")
    from google.auth.transport.requests import AuthorizedSession
    return AuthorizedSession(credentials), project


def resolve(url: str) -> tuple[list[str], str]:
    """(agent addresses in worker order, accelerator type) of the TPU at ``url``."""
    ref = TpuRef.parse(url)
    ips, accelerator = workers(ref)
    return [join_host_port(ip, ref.port) for ip in ips], accelerator


def workers(ref: TpuRef, prefer_external: bool = False) -> tuple[list[str], str]:
    """(the workers' IPs in worker order, accelerator type) of the TPU ``ref``
    names (external IPs with ``&external=1``; with ``prefer_external``, each
    worker's external IP where it has one, as gcloud's ssh does)."""
    session, project = _session_and_project(ref.project)
    api = os.environ.get(API_ENV, _DEFAULT_API).rstrip("/")
    node = f"projects/{project}/locations/{ref.zone}/nodes/{ref.name}"
    try:
        reply = session.get(f"{api}/v2/{node}", timeout=15)
    except Exception as exc:  # noqa: BLE001 - any transport failure
        raise ConfigurationError(f"could not reach the Cloud TPU API at {api}: {exc}") from None
    if reply.status_code == 404:
        raise ConfigurationError(f"there is no TPU {ref.name!r} in zone {ref.zone} of project "
                                 f"{project}")
    if reply.status_code in (401, 403):
        raise ConfigurationError(f"the Cloud TPU API refused to describe {node} "
                                 f"(HTTP {reply.status_code}): these credentials lack "
                                 "tpu.nodes.get on it")
    if reply.status_code != 200:
        raise ConfigurationError(f"the Cloud TPU API answered HTTP {reply.status_code} for "
                                 f"{node}: {reply.text[:200]}")
    body = reply.json()
    state = body.get("state", "")
    if state and state != "READY":
        raise ConfigurationError(f"TPU {ref.name!r} is {state}, not READY")
    ips = []
    for endpoint in body.get("networkEndpoints", []):
        external = endpoint.get("accessConfig", {}).get("externalIp")
        ip = external if ref.external else (
            external or endpoint.get("ipAddress") if prefer_external
            else endpoint.get("ipAddress"))
        if not ip:
            raise ConfigurationError(f"TPU {ref.name!r} has a worker without an "
                                     f"{'external' if ref.external else 'internal'} IP")
        ips.append(ip)
    if not ips:
        raise ConfigurationError(f"TPU {ref.name!r} lists no network endpoints")
    return ips, body.get("acceleratorType", "")
