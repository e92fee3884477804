"""``--idle-delete MINUTES``: a slice left idle deletes itself, as SkyPilot's
autostop does, through the Cloud TPU API (v2, REST) with the VM's own service
account; and where that account may not, says so plainly.

Only the gateway (worker 0) decides, for the whole slice: its ``IdleClock``
(``host.idle``) calls ``SliceDeleter.delete`` once nothing has run, waited or
been held warm for MINUTES. The call is ``DELETE
https://tpu.googleapis.com/v2/RESOURCE`` (``?force=true`` for a queued resource:
its nodes go too) with an access token from the GCE metadata server
(``instance/service-accounts/default/token``). ``REMOTE_TPU_TPU_API`` points it
at another endpoint, as it does the client's (a test stand-in, say).

At start the VM's scopes are read (``.../default/scopes``): without
``cloud-platform`` the API refuses any call, and a warning says so at once. What
the last try met (a 403: the account's IAM roles lack the permission) is kept:
``status`` is what ``remote-tpu doctor`` shows for worker 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from typing import TYPE_CHECKING

from remote_tpu._core.exceptions import ConfigurationError

from remote_tpu_agent.wire.discovery import MetadataServer

if TYPE_CHECKING:
    import urllib.error

log = logging.getLogger(__name__)

API_ENV = "REMOTE_TPU_TPU_API"       # the client's too (``remote_tpu._cloud.API_ENV``)
DEFAULT_API = "https://tpu.googleapis.com"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
_SERVICE_ACCOUNT = "instance/service-accounts/default"
_RESOURCE = re.compile(r"projects/([a-z0-9][a-z0-9.:-]{0,62})/locations/([a-z0-9-]{1,63})/"
                       r"(queuedResources|nodes)/([a-z0-9][a-z0-9-]{0,62})")
RESOURCE_FORMS = ("projects/PROJECT/locations/ZONE/queuedResources/NAME (what `remote-tpu up "
                  "NAME` makes) or projects/PROJECT/locations/ZONE/nodes/NAME (a TPU VM "
                  "made without a queued resource)")
MAX_MINUTES = 7 * 24 * 60


def check_minutes(text: str) -> float:
    """``--idle-delete``'s value: minutes, more than 0 (fractions allowed)."""
    try:
        minutes = float(text)
    except ValueError:
        raise ValueError(f"--idle-delete {text!r} is not a number of minutes (e.g. 30, or "
                         "0.5 for 30 s)") from None
    if not (math.isfinite(minutes) and 0 < minutes <= MAX_MINUTES):
        raise ValueError(f"--idle-delete {text!r}: give minutes above 0 and at most "
                         f"{MAX_MINUTES} (a week)")
    return minutes


def check_resource(text: str) -> str:
    """``--idle-delete-resource``'s value: a queued resource's or node's full name."""
    name = text.strip().strip("/")
    if _RESOURCE.fullmatch(name) is None:
        raise ValueError(f"--idle-delete-resource {text!r} is not a queued resource or TPU "
                         f"node: give {RESOURCE_FORMS}")
    return name


def _clock() -> str:
    return time.strftime("%H:%M:%S")


class SliceDeleter:
    """Deletes ``resource`` when asked; keeps what stands in its way."""

    def __init__(self, minutes: float, resource: str,
                 metadata: MetadataServer | None = None) -> None:
        self.minutes = minutes
        self.resource = check_resource(resource)
        self._metadata = metadata or MetadataServer()
        self._api = (os.environ.get(API_ENV) or DEFAULT_API).rstrip("/")
        self._forbidden = ""      # what the VM's scopes say, read at start
        self._last = ""           # what the last try met
        self._deleting = ""       # the API took the delete: when, its operation

    @property
    def url(self) -> str:
        force = "?force=true" if "/queuedResources/" in self.resource else ""
        return f"{self._api}/v2/{self.resource}{force}"

    @property
    def down_command(self) -> str:
        """What deletes it by hand."""
        project, zone, _, name = _RESOURCE.fullmatch(self.resource).groups()
        return f"remote-tpu down {name} --zone {zone} --project {project}"

    def check_access(self) -> None:
        """Read the VM's scopes; a warning now if the API will refuse the delete."""
        try:
            scopes = self._metadata.get(f"{_SERVICE_ACCOUNT}/scopes")
        except ConfigurationError as exc:
            self._forbidden = (f"will fail: the VM's service account cannot be asked "
                               f"({exc}); is this a Cloud TPU VM?")
        else:
            if scopes is None:
                self._forbidden = ("will be refused: this VM has no service account (the "
                                   "metadata server lists none)")
            elif CLOUD_PLATFORM not in scopes.split():
                self._forbidden = (
                    "will be refused: the VM's service account lacks the cloud-platform "
                    f"scope ({CLOUD_PLATFORM}; it has {', '.join(scopes.split()) or 'none'}): "
                    f"create the TPU VM with that scope, or delete it yourself "
                    f"({self.down_command})")
        if self._forbidden:
            log.warning("--idle-delete %g: deleting %s %s", self.minutes, self.resource,
                        self._forbidden)
        else:
            log.info("--idle-delete %g: this slice deletes %s after %g minute(s) with "
                     "nothing to do", self.minutes, self.resource, self.minutes)

    def status(self) -> tuple[str, str]:
        """(what ``doctor`` shows, the problem in it or "")."""
        head = f"idle-delete after {self.minutes:g} min"
        if self._deleting:
            return f"{head}: {self._deleting}", ""
        problem = self._last or self._forbidden
        if problem:           # the row says what, the problems why (the one to read)
            return (f"{head}: {problem.partition(': ')[0]} (see problems)",
                    f"{head} of {self.resource}: {problem}")
        return f"{head}: on", ""

    def delete(self, idle_seconds: float) -> bool:
        """Ask the API to delete the slice; whether it took the request."""
        import urllib.error           # (here: an agent that never deletes never imports them)
        import urllib.request

        log.warning("idle for %s (--idle-delete %g): deleting %s", _duration(idle_seconds),
                    self.minutes, self.resource)
        try:
            token = self._token()
        except (ConfigurationError, ValueError, KeyError) as exc:
            return self._failed(f"failed: no access token from the metadata server ({exc})")
        request = urllib.request.Request(self.url, method="DELETE",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                body = reply.read()
        except urllib.error.HTTPError as exc:
            return self._failed(self._refusal(exc))
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return self._failed(f"failed: cannot reach the Cloud TPU API at {self._api} "
                                f"({reason})")
        operation = _field(body, "name")
        self._deleting = f"deleting since {_clock()}" + (
            f" (operation {operation})" if operation else "")
        self._last = ""
        log.warning("the Cloud TPU API is deleting %s: this VM goes with it%s",
                    self.resource, f" (operation {operation})" if operation else "")
        return True

    def _token(self) -> str:
        text = self._metadata.get(f"{_SERVICE_ACCOUNT}/token")
        if text is None:
            raise ValueError("this VM has no service account")
        return json.loads(text)["access_token"]

    def _refusal(self, exc: urllib.error.HTTPError) -> str:
        message = _field(exc.read(), "error", "message") or exc.reason
        if exc.code in (401, 403):
            return (f"refused: HTTP {exc.code}: {message} (the VM's service account needs "
                    "the cloud-platform scope and a role with tpu.queuedResources.delete and "
                    "tpu.nodes.delete, e.g. roles/tpu.admin)")
        if exc.code == 404:
            return (f"failed: HTTP 404: {message} (gone already, or not this slice: check "
                    "--idle-delete-resource)")
        return f"failed: HTTP {exc.code}: {message}"

    def _failed(self, why: str) -> bool:
        self._last = f"last try ({_clock()}) {why}"
        log.error("--idle-delete: %s was not deleted: %s; trying again after another %g "
                  "idle minute(s)", self.resource, why, self.minutes)
        return False


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _field(body: bytes, *keys: str) -> str:
    """A string inside a JSON reply, or "" (the reply cut short to 300 characters)."""
    try:
        value = json.loads(body or b"{}")
        for key in keys:
            value = value[key]
    except (ValueError, KeyError, TypeError):
        return ""
    return str(value)[:300]
