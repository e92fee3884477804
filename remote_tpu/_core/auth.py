"""Credentials of a slice, shared by the client and the agent.

- The slice token: a random secret every call carries as call metadata and
  every agent checks, in constant time, before it reads anything else.
- TLS: the agent's certificate and key; the CA that vouches for agents (and,
  in mutual TLS, for clients); a client certificate for mutual TLS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat

from .dirs import make_private
from .exceptions import ConfigurationError

TOKEN_METADATA_KEY = "x-remote-tpu-token"
TOKEN_ENV = "REMOTE_TPU_TOKEN"
TOKEN_FILE_ENV = "REMOTE_TPU_TOKEN_FILE"
_TOKEN_MIN_LENGTH = 16


def default_token_file() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "remote_tpu", "token")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token_file(path: str, token: str, *, overwrite: bool = False) -> None:
    """Write ``token`` to ``path`` with mode 0600 (the directories made for
    it 0700)."""
    make_private(os.path.dirname(os.path.abspath(path)))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigurationError(f"token file {path} already exists; pass --force to replace "
                                 "it (every client and agent of the slice then needs the "
                                 "new token)") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")


def read_token_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigurationError(f"cannot read token file {path}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigurationError(
            f"token file {path} can be read by other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
    return check_token(token, f"token file {path}")


def check_token(token: str, where: str) -> str:
    if not isinstance(token, str) or len(token) < _TOKEN_MIN_LENGTH or \
            not token.isprintable() or " " in token:
        raise ConfigurationError(
            f"{where} does not hold a usable token (at least {_TOKEN_MIN_LENGTH} printable "
            "characters, no spaces); create one with `remote-tpu-agent token init`")
    return token


def client_token(explicit: str | None) -> str | None:
    """The token a client sends: ``token=`` > $REMOTE_TPU_TOKEN >
    $REMOTE_TPU_TOKEN_FILE > the default token file, if it exists."""
    if explicit is not None:
        return check_token(explicit, "token=")
    env = os.environ.get(TOKEN_ENV)
    if env:
        return check_token(env, f"${TOKEN_ENV}")
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_token_file(path)
    path = default_token_file()
    return read_token_file(path) if os.path.exists(path) else None


def tokens_match(received: str | bytes | None, expected: str) -> bool:
    """Constant-time comparison (digests, so lengths do not leak either)."""
    if received is None:
        return False
    if isinstance(received, str):
        received = received.encode()
    return hmac.compare_digest(hashlib.sha256(received).digest(),
                               hashlib.sha256(expected.encode()).digest())


@dataclasses.dataclass(frozen=True)
class TLS:
    """TLS settings for the connection to an agent.

    ca: PEM file of the CA that signed the agents' certificates (required).
    cert, key: this side's certificate and key, for agents that demand mutual TLS.
    server_name: the name to check the agent's certificate against, when it is
        not the address dialed (an SSH tunnel to localhost, say).
    """

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigurationError("TLS(cert=..., key=...) needs both a certificate and "
                                     "its key, or neither")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigurationError(f"TLS {name}={path!r}: no such file")

    @classmethod
    def from_env(cls) -> TLS | None:
        ca = os.environ.get("REMOTE_TPU_TLS_CA")
        if not ca:
            return None
        return cls(ca=ca, cert=os.environ.get("REMOTE_TPU_TLS_CERT") or None,
                   key=os.environ.get("REMOTE_TPU_TLS_KEY") or None,
                   server_name=os.environ.get("REMOTE_TPU_TLS_SERVER_NAME") or None)

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        def load(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()
        return load(self.ca) or b"", load(self.key), load(self.cert)

