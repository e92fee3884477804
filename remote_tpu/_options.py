"""One frozen options object per decorated function.

Precedence: explicit argument > ``REMOTE_TPU_*`` environment variable > default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence

from ._core.auth import TLS, check_token
from ._core.addresses import Hosts, parse_hosts
from ._core.exceptions import ConfigurationError
from ._core.topology import Topology

STREAM_MODES = ("leader", "all", "none")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY",
                          re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class JaxTimeouts:
    initialization: int = 120
    heartbeat: int = 20
    shutdown: int = 5


@dataclasses.dataclass(frozen=True)
class RunOptions:
    topology: Topology
    hosts: Hosts                    # local, tpu://..., or agent addresses (first = gateway)
    timeout: float | None
    stream: str
    env: tuple[tuple[str, str], ...]
    jax_timeouts: JaxTimeouts
    token: str | None = dataclasses.field(default=None, repr=False)   # None: look it up per call
    tls: TLS | None = None
    processes_per_host: int = 1
    keep_warm: float = 0.0            # seconds the workers stay after a call; 0 = none
    init_jax: bool = True             # False: no jax import, no jax.distributed
    working_dir: str = ""             # absolute; "" = none
    output_dir: str = ""              # gs://bucket/prefix, or an absolute local path; "" = none
    staging: str = ""                 # gs://bucket/prefix for local remote_tpu.Data; "" = none
    requirements: tuple[str, ...] = ()  # pip requirement lines
    allow_jax_requirements: bool = False
    retries: object = None            # a _retries.Retries, or None
    num_slices: int = 1
    slices: tuple[Hosts, ...] = ()    # num_slices > 1, not local: each slice's hosts
    keep_going: bool = False          # no fail-fast (`remote-tpu exec`)
    profile: float = 0.0              # seconds of jax.profiler trace (inf: the call); 0 = off

    @property
    def local(self) -> bool:
        return self.hosts.local


def _from_env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


# Every REMOTE_TPU_* variable remote_tpu reads or sets, on a client, an agent or
# in a worker (tests/unit/test_options.py checks the code names no other).
KNOWN_VARIABLES = frozenset({
    "REMOTE_TPU_ACCELERATOR", "REMOTE_TPU_HOSTS", "REMOTE_TPU_TIMEOUT", "REMOTE_TPU_STREAM",
    "REMOTE_TPU_KEEP_WARM", "REMOTE_TPU_WORKING_DIR", "REMOTE_TPU_OUTPUT_DIR",
    "REMOTE_TPU_STAGING", "REMOTE_TPU_RETRIES", "REMOTE_TPU_NUM_SLICES", "REMOTE_TPU_TOKEN",
    "REMOTE_TPU_TOKEN_FILE", "REMOTE_TPU_TLS_CA", "REMOTE_TPU_TLS_CERT", "REMOTE_TPU_TLS_KEY",
    "REMOTE_TPU_TLS_SERVER_NAME", "REMOTE_TPU_REQUIRE_TLS", "REMOTE_TPU_TPU_API",
    "REMOTE_TPU_SHOW_SDK_FRAMES", "REMOTE_TPU_DEPS", "REMOTE_TPU_PYTHON",
    # set by an agent for its workers and the function
    "REMOTE_TPU_JOB_ID", "REMOTE_TPU_HOST_INDEX", "REMOTE_TPU_PROCESS_INDEX",
    "REMOTE_TPU_NUM_HOSTS", "REMOTE_TPU_SLICE_ID", "REMOTE_TPU_ATTEMPT", "REMOTE_TPU_JOB_DIR",
    "REMOTE_TPU_SHARED_OUTPUT_DIR", "REMOTE_TPU_GCS_CACHE", "REMOTE_TPU_PROFILE",
    "REMOTE_TPU_INIT_JAX", "REMOTE_TPU_SIMULATE_DEVICES", "REMOTE_TPU_STATUS_FD",
    "REMOTE_TPU_CONTROL_FD", "REMOTE_TPU_AGENT_LOG", "REMOTE_TPU_JAX_INIT_TIMEOUT",
    "REMOTE_TPU_JAX_HEARTBEAT_TIMEOUT", "REMOTE_TPU_JAX_SHUTDOWN_TIMEOUT",
})
_warned_variables: set[str] = set()


def warn_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """Warn once per name of a set ``REMOTE_TPU_*`` variable that nothing
    reads (a misspelt one is otherwise silently ignored), with the nearest."""
    for name in sorted(environ):
        if not name.startswith("REMOTE_TPU_") or name in KNOWN_VARIABLES or \
                name in _warned_variables:
            continue
        _warned_variables.add(name)
        near = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.75)
        warnings.warn(f"{name} is set but remote_tpu reads no such variable"
                      + (f": did you mean {near[0]}?" if near else
                         "; see the README's list of options for the ones it reads"),
                      UserWarning, stacklevel=4)


@contextlib.contextmanager
def _variable(explicit: object, name: str) -> Iterator[None]:
    """An error in a value taken from the variable ``name`` (``explicit``
    None) names the variable, so the user knows where it came from."""
    raw = _from_env(name) if explicit is None else None
    try:
        yield
    except ConfigurationError as exc:
        if raw is None or name in str(exc):
            raise
        said = str(exc).rstrip(".")
        raise ConfigurationError(f"{name}={raw!r} (from the environment): {said}; fix or "
                                 f"unset {name}") from None


def _checked_hosts(hosts: str | Sequence[str] | None, topology: Topology) -> Hosts:
    parsed = parse_hosts(hosts)
    if len(parsed.entries) > 1:          # one address: the gateway knows its peers
        topology.check_host_count(parsed.entries, parsed.source)
    return parsed


def _positive(name: str, value: object, env: str) -> float | None:
    if value is None:
        raw = _from_env(env)
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ConfigurationError(f"{env}={raw!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds or None, "
                                 f"got {value!r}")
    return float(value)


def _keep_warm(value: float | None) -> float:
    """``keep_warm=``: seconds, 0 or None = off (``REMOTE_TPU_KEEP_WARM``)."""
    if value is None:
        raw = _from_env("REMOTE_TPU_KEEP_WARM")
        if raw is None:
            return 0.0
        try:
            value = float(raw)
        except ValueError:
            raise ConfigurationError(f"REMOTE_TPU_KEEP_WARM={raw!r} is not a number of "
                                     "seconds (0 = off)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value <= 7 * 86400:
        raise ConfigurationError(f"keep_warm must be a number of seconds from 0 (off) to "
                                 f"604800 (a week), or None; got {value!r}")
    return float(value)


def _working_dir(value: str | os.PathLike | None) -> str:
    """``working_dir=``: an existing directory (``REMOTE_TPU_WORKING_DIR``)."""
    if value is None:
        value = _from_env("REMOTE_TPU_WORKING_DIR")
        if value is None:
            return ""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"working_dir= must be a path to a directory, got {value!r}")
    path = os.path.abspath(os.path.expanduser(os.fspath(value)))
    if not os.path.isdir(path):
        raise ConfigurationError(f"working_dir={os.fspath(value)!r}: {path} is not a directory "
                                 "(give the project directory the function's files are in)")
    return path


def _output_dir(value: str | os.PathLike | None) -> str:
    """``output_dir=``: ``gs://bucket[/prefix]`` or a local directory, made if
    missing (``REMOTE_TPU_OUTPUT_DIR``)."""
    if value is None:
        value = _from_env("REMOTE_TPU_OUTPUT_DIR")
        if value is None:
            return ""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"output_dir= must be gs://bucket/prefix or a local "
                                 f"directory, got {value!r}")
    text = os.fspath(value)
    if text.startswith("gs://"):
        bucket = text[len("gs://"):].split("/", 1)[0]
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
            raise ConfigurationError(f"output_dir={text!r}: {bucket!r} is not a bucket name "
                                     "(write gs://BUCKET/PREFIX)")
        return text.rstrip("/")
    if "://" in text:
        raise ConfigurationError(f"output_dir={text!r}: only gs:// URIs and local directories "
                                 "are supported")
    path = os.path.abspath(os.path.expanduser(text))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"output_dir={text!r}: cannot make {path}: "
                                 f"{exc.strerror}") from None
    return path


def _staging(value: str | None) -> str:
    """``staging=``: where local remote_tpu.Data goes first (``REMOTE_TPU_STAGING``)."""
    if value is None:
        value = _from_env("REMOTE_TPU_STAGING") or ""
    if value and (not isinstance(value, str) or not value.startswith("gs://") or
                  not value[len("gs://"):].split("/", 1)[0]):
        raise ConfigurationError(f"staging={value!r}: give a gs://bucket/prefix")
    return value.rstrip("/") if value else ""


def _requirements(value: Sequence[str] | str | os.PathLike | None,
                  allow_jax: bool) -> tuple[str, ...]:
    """``requirements=``: requirement strings, or the path of a requirements file."""
    from ._core.requirements import protected, refusal

    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        path = os.path.abspath(os.path.expanduser(os.fspath(value)))
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ConfigurationError(f"requirements={os.fspath(value)!r}: cannot read {path} "
                                     f"({exc.strerror}); give a requirements file or a list "
                                     "of requirement strings") from None
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise ConfigurationError(f"requirements= must be a list of requirement strings or a "
                                 f"requirements file's path, got {value!r}")
    kept = tuple(line.strip() for line in lines
                 if line.strip() and not line.strip().startswith("#"))
    bad = protected(kept)
    if bad and allow_jax is not True:
        raise ConfigurationError(refusal(bad))
    return kept


def _profile(value: bool | float, output_dir: str, init_jax: bool) -> float:
    """``profile=``: True (the whole call), seconds (its first ones), or off."""
    if value is False or value is None or value == 0:
        return 0.0
    seconds = float("inf") if value is True else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ConfigurationError(f"profile= must be True, False or a number of seconds, "
                                 f"got {value!r}")
    if not output_dir:
        raise ConfigurationError("profile= writes each host's jax.profiler trace to the job's "
                                 "output directory: pass output_dir='gs://bucket/prefix' or a "
                                 "local directory")
    if not init_jax:
        raise ConfigurationError("profile= traces JAX: it needs init_jax=True")
    return float(seconds)


def _retries(value: object) -> object:
    """``retries=``: an int, a remote_tpu.Retries, or None (``REMOTE_TPU_RETRIES``)."""
    from ._retries import coerce

    if value is None:
        raw = _from_env("REMOTE_TPU_RETRIES")
        if raw is not None:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigurationError(f"REMOTE_TPU_RETRIES={raw!r} is not a number of "
                                         "retries") from None
    return coerce(value)


def resolve(*, accelerator: str | Topology | None, hosts: str | Sequence[str] | None,
            timeout: float | None, stream: str | None,
            env: Mapping[str, str] | None, jax_timeouts: JaxTimeouts | None,
            token: str | None = None, tls: TLS | None = None,
            processes_per_host: int = 1, keep_warm: float | None = None,
            init_jax: bool = True, working_dir: str | os.PathLike | None = None,
            output_dir: str | os.PathLike | None = None,
            staging: str | None = None,
            requirements: Sequence[str] | str | os.PathLike | None = None,
            allow_jax_requirements: bool = False,
            retries: object = None, num_slices: int | None = None,
            profile: bool | float = False) -> RunOptions:
    warn_unknown_variables()
    given_accelerator = accelerator
    if accelerator is None:
        accelerator = _from_env("REMOTE_TPU_ACCELERATOR")
        if accelerator is None:
            raise ConfigurationError(
                "remote_tpu.run needs accelerator=, for example accelerator='tpu-v4-16' "
                "(or set REMOTE_TPU_ACCELERATOR)")
    with _variable(given_accelerator, "REMOTE_TPU_ACCELERATOR"):
        topology = Topology.parse(accelerator)
    mode = stream if stream is not None else (_from_env("REMOTE_TPU_STREAM") or "leader")
    if mode not in STREAM_MODES:
        with _variable(stream, "REMOTE_TPU_STREAM"):
            raise ConfigurationError(f"stream={mode!r} is not one of {', '.join(STREAM_MODES)}")
    env_items: list[tuple[str, str]] = []
    if env is not None:
        if not isinstance(env, Mapping):
            raise ConfigurationError(f"env= must be a mapping of names to strings, got "
                                     f"{type(env).__name__}")
        for k, v in env.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise ConfigurationError(f"env= name {k!r} is not a valid variable name")
            if not isinstance(v, str):
                raise ConfigurationError(f"env={{{k!r}: ...}} must be a string, got "
                                         f"{type(v).__name__} {v!r}")
            env_items.append((k, v))
            if _SECRET_NAME.search(k):
                warnings.warn(
                    f"env= sends {k} to every host of the slice, inside the job spec; make "
                    "sure that is intended (secrets are better read on the hosts "
                    "themselves)", UserWarning, stacklevel=4)
    jt = jax_timeouts or JaxTimeouts()
    for f in dataclasses.fields(jt):
        v = getattr(jt, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigurationError(f"jax_timeouts.{f.name} must be a positive int of "
                                     f"seconds, got {v!r}")
    if token is not None:
        check_token(token, "token=")
    n = processes_per_host
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or \
            topology.chips_per_host % n or topology.devices_per_host % n:
        divisors = [d for d in range(1, topology.chips_per_host + 1)
                    if topology.chips_per_host % d == 0]
        raise ConfigurationError(
            f"processes_per_host={n!r}: {topology.name} has {topology.chips_per_host} chips "
            f"per host, to share evenly; use one of {', '.join(map(str, divisors))}")
    if not isinstance(init_jax, bool):
        raise ConfigurationError(f"init_jax= must be True or False, got {init_jax!r}")
    if tls is not None and not isinstance(tls, TLS):
        raise ConfigurationError(f"tls= must be a remote_tpu.TLS(ca=...), got {tls!r}")
    from ._slices import num_slices_of, parse_slices

    slices_n = num_slices_of(num_slices)
    if slices_n > 1 and n > 1:
        raise ConfigurationError(
            f"processes_per_host={n} with num_slices={slices_n}: every process of a host "
            "would need a MEGASCALE_PORT of its own, which libtpu does not document; use "
            "processes_per_host=1 on several slices")
    if slices_n > 1:
        parsed, slices = parse_slices(hosts, slices_n, topology, dict(env_items))
    else:
        parsed, slices = _checked_hosts(hosts, topology), ()
    with _variable(output_dir, "REMOTE_TPU_OUTPUT_DIR"):
        output = _output_dir(output_dir)
    with _variable(timeout, "REMOTE_TPU_TIMEOUT"):
        timeout = _positive("timeout", timeout, "REMOTE_TPU_TIMEOUT")
    with _variable(keep_warm, "REMOTE_TPU_KEEP_WARM"):
        keep_warm = _keep_warm(keep_warm)
    with _variable(working_dir, "REMOTE_TPU_WORKING_DIR"):
        working_dir = _working_dir(working_dir)
    with _variable(staging, "REMOTE_TPU_STAGING"):
        staging = _staging(staging)
    with _variable(retries, "REMOTE_TPU_RETRIES"):
        retries = _retries(retries)
    return RunOptions(
        profile=_profile(profile, output, init_jax),
        num_slices=slices_n,
        slices=slices,
        token=token,
        tls=tls if tls is not None else TLS.from_env(),
        processes_per_host=processes_per_host,
        topology=topology,
        hosts=parsed,
        timeout=timeout,
        stream=mode,
        env=tuple(sorted(env_items)),
        jax_timeouts=jt,
        keep_warm=keep_warm,
        init_jax=init_jax,
        working_dir=working_dir,
        output_dir=output,
        staging=staging,
        requirements=_requirements(requirements, allow_jax_requirements),
        allow_jax_requirements=allow_jax_requirements,
        retries=retries,
    )
