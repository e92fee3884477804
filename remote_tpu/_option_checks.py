"""The checks of ``remote_tpu.run()``'s options, one per option, named in the
table of ``_options``.

Each check takes the value given (or read from its ``REMOTE_TPU_*`` variable,
or the default) and ``get``, which gives another option's checked value, and
returns the option's checked value, or raises ConfigurationError saying what
was received, what is allowed and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._core.auth import TLS, check_token
from ._core.addresses import Hosts, parse_hosts
from ._core.exceptions import ConfigurationError
from ._core.topology import Topology

Get = Callable[[str], Any]      # another option's checked value, by name

STREAM_MODES = ("leader", "all", "none")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY",
                          re.IGNORECASE)
_JOB_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,39}$")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class JaxTimeouts:
    initialization: int = 120
    heartbeat: int = 20
    shutdown: int = 5


def user_stacklevel() -> int:
    """The ``stacklevel`` of a warning about an option that points at the
    user's line: the first frame outside this package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


# ---------------------------------------------------------------- a variable's text

def seconds(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError("not a number of seconds") from None


def whole(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError("not a whole number") from None


# ---------------------------------------------------------------- the checks

def accelerator(value: str | Topology | None, get: Get) -> Topology:
    if value is None:
        raise ConfigurationError(
            "remote_tpu.run needs accelerator=, for example accelerator='tpu-v4-16' "
            "(or set REMOTE_TPU_ACCELERATOR)")
    return Topology.parse(value)


def hosts(value: str | Sequence[str] | None, get: Get) -> tuple[Hosts, tuple[Hosts, ...]]:
    """(the slice, or slice 0 of several; every slice's hosts when several
    are not simulated). ``REMOTE_TPU_HOSTS`` is read by ``parse_hosts``."""
    from ._slices import parse_slices

    topology, n = get("accelerator"), get("num_slices")
    if n > 1:
        return parse_slices(value, n, topology, dict(get("env")))
    parsed = parse_hosts(value)
    if len(parsed.entries) > 1:          # one address: the gateway knows its peers
        topology.check_host_count(parsed.entries, parsed.source)
    return parsed, ()


def timeout(value: float | None, get: Get) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value < float("inf"):        # (nan is neither: refused too)
        raise ConfigurationError(f"timeout must be a positive, finite number of seconds "
                                 f"(or none at all), got {value!r}")
    return float(value)


def stream(value: str | None, get: Get) -> str:
    mode = "leader" if value is None else value
    if mode not in STREAM_MODES:
        raise ConfigurationError(f"stream={mode!r} is not one of {', '.join(STREAM_MODES)}")
    return mode


def env(value: Mapping[str, str] | None, get: Get) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"env= must be a mapping of names to strings, got "
                                 f"{type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise ConfigurationError(f"env= name {k!r} is not a valid variable name")
        if not isinstance(v, str):
            raise ConfigurationError(f"env={{{k!r}: ...}} must be a string, got "
                                     f"{type(v).__name__} {v!r}")
        if _SECRET_NAME.search(k):
            warnings.warn(
                f"env= sends {k} to every host of the slice, inside the job spec; make "
                "sure that is intended (secrets are better read on the hosts "
                "themselves)", UserWarning, stacklevel=user_stacklevel())
    return tuple(sorted(value.items()))


def jax_timeouts(value: JaxTimeouts | None, get: Get) -> JaxTimeouts:
    jt = JaxTimeouts() if value is None else value
    if not isinstance(jt, JaxTimeouts):
        raise ConfigurationError(f"jax_timeouts= must be remote_tpu.JaxTimeouts(initialization="
                                 f"..., heartbeat=..., shutdown=...), got {value!r}")
    for f in dataclasses.fields(jt):
        v = getattr(jt, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigurationError(f"jax_timeouts.{f.name} must be a positive int of "
                                     f"seconds, got {v!r}")
    return jt


def token(value: str | None, get: Get) -> str | None:
    """None: looked up for each call (``REMOTE_TPU_TOKEN``, ``_TOKEN_FILE``, ...)."""
    if value is not None:
        check_token(value, "token=")
    return value


def tls(value: TLS | None, get: Get) -> TLS | None:
    if value is None:
        return TLS.from_env()
    if not isinstance(value, TLS):
        raise ConfigurationError(f"tls= must be a remote_tpu.TLS(ca=...), got {value!r}")
    return value


def processes_per_host(value: int | None, get: Get) -> int:
    """None: the accelerator's own (TPU7x: 2, the processes GKE runs per VM)."""
    topology = get("accelerator")
    n = topology.gke_processes_per_host if value is None else value
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or \
            topology.chips_per_host % n or topology.devices_per_host % n:
        divisors = [d for d in range(1, topology.chips_per_host + 1)
                    if topology.chips_per_host % d == 0]
        raise ConfigurationError(
            f"processes_per_host={n!r}: {topology.name} has {topology.chips_per_host} chips "
            f"per host, to share evenly; use one of {', '.join(map(str, divisors))}")
    slices = get("num_slices")
    if slices > 1 and n > 1:
        raise ConfigurationError(
            f"processes_per_host={n} with num_slices={slices}: every process of a host "
            "would need a MEGASCALE_PORT of its own, which libtpu does not document; use "
            "processes_per_host=1 on several slices")
    return n


def keep_warm(value: float | None, get: Get) -> float:
    """Seconds, 0 or None = off."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value <= 7 * 86400:
        raise ConfigurationError(f"keep_warm must be a number of seconds from 0 (off) to "
                                 f"604800 (a week), or None; got {value!r}")
    return float(value)


def init_jax(value: bool, get: Get) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"init_jax= must be True or False, got {value!r}")
    return value


def working_dir(value: str | os.PathLike | None, get: Get) -> str:
    """An existing directory, made absolute; "" = none."""
    if value is None:
        return ""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"working_dir= must be a path to a directory, got {value!r}")
    path = os.path.abspath(os.path.expanduser(os.fspath(value)))
    if not os.path.isdir(path):
        raise ConfigurationError(f"working_dir={os.fspath(value)!r}: {path} is not a directory "
                                 "(give the project directory the function's files are in)")
    return path


def output_dir(value: str | os.PathLike | None, get: Get) -> str:
    """``gs://bucket[/prefix]`` or a local directory, made if missing; "" = none."""
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


def staging(value: str | None, get: Get) -> str:
    """Where local remote_tpu.Data goes first; "" = none."""
    if value and (not isinstance(value, str) or not value.startswith("gs://") or
                  not value[len("gs://"):].split("/", 1)[0]):
        raise ConfigurationError(f"staging={value!r}: give a gs://bucket/prefix")
    return value.rstrip("/") if value else ""


def requirement_lines(path: str | os.PathLike, said: str = "requirements=") -> list[str]:
    """The lines of a requirements file, or an error naming it."""
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    try:
        with open(full, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigurationError(f"{said}{os.fspath(path)!r}: cannot read {full} ({why}); "
                                 "give a requirements file or a list of requirement "
                                 "strings") from None


def requirements(value: Sequence[str] | str | os.PathLike | None,
                 get: Get) -> tuple[str, ...]:
    """Requirement strings, or the path of a requirements file: its lines,
    without blank ones and comments."""
    from ._core.requirements import protected, refusal

    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        lines = requirement_lines(value)
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise ConfigurationError(f"requirements= must be a list of requirement strings or a "
                                 f"requirements file's path, got {value!r}")
    kept = tuple(line.strip() for line in lines
                 if line.strip() and not line.strip().startswith("#"))
    bad = protected(kept)
    if bad and not get("allow_jax_requirements"):
        raise ConfigurationError(refusal(bad))
    return kept


def allow_jax_requirements(value: bool, get: Get) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"allow_jax_requirements= must be True or False, got "
                                 f"{value!r}")
    return value


def all_results(value: bool | None, get: Get) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigurationError(f"all_results= must be True or False, got {value!r}")
    return value


def compilation_cache(value: str | bool | os.PathLike | None, get: Get) -> str:
    """None: "" (the agent's own); False: "off"; a gs:// URI or an absolute
    path on the hosts, as it is."""
    if value is None or value is True:
        return ""
    if value is False:
        return "off"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        where = value.strip()
        if where.startswith("gs://") and len(where) > len("gs://"):
            return where
        if os.path.isabs(where) and where != "off":
            return where
    raise ConfigurationError(
        f"compilation_cache= must be a gs://bucket/prefix, an absolute path on the hosts, "
        f"False (off) or None (the agent's own directory), got {value!r}")


def compilation_cache_text(text: str) -> str | bool:
    """The variable's or flag's text: "off" (or 0, false, no) for off."""
    if text.strip().lower() in ("off", "0", "false", "no"):
        return False
    return text


DEFAULT_STALL_AFTER = 300.0
ON_STALL = ("report", "cancel")


def stall_after(value: float | bool | None, get: Get) -> float:
    """Seconds; None or True: the default; 0 or False: off."""
    if value is None or value is True:
        return DEFAULT_STALL_AFTER
    if value is False:
        return 0.0
    if isinstance(value, (int, float)) and 0 <= value <= 7 * 86400:
        return float(value)
    raise ConfigurationError(
        f"stall_after= must be a number of seconds from 0 (off) to 604800 (a week), "
        f"False (off) or None ({DEFAULT_STALL_AFTER:g} s); got {value!r}")


def stall_after_text(text: str) -> float | bool:
    """The variable's or flag's text: seconds, or off."""
    if text.strip().lower() in ("off", "false", "no"):
        return False
    try:
        return float(text)
    except ValueError:
        raise ConfigurationError(f"stall after {text!r}: give a number of seconds, "
                                 "or off") from None


def on_stall(value: str | None, get: Get) -> str:
    chosen = "report" if value is None else value
    if chosen not in ON_STALL:
        raise ConfigurationError(f"on_stall={chosen!r} is not one of "
                                 f"{', '.join(map(repr, ON_STALL))}")
    return chosen


def flag_text(text: str) -> bool:
    """A true/false environment variable's text."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{text!r} is not true or false: use 1 or 0")


def retries(value: object, get: Get) -> object:
    """A ``_retries.Retries``, or None."""
    from ._retries import coerce

    return coerce(value)  # type: ignore[arg-type]


def num_slices(value: int | None, get: Get) -> int:
    """1 to 64."""
    from ._slices import num_slices_of

    return num_slices_of(value)


def profile(value: bool | float, get: Get) -> float:
    """True (the whole call: inf), seconds (its first ones), or 0.0 = off."""
    if value is False or value is None or value == 0:
        return 0.0
    secs = float("inf") if value is True else value
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs < 0:
        raise ConfigurationError(f"profile= must be True, False or a number of seconds, "
                                 f"got {value!r}")
    if not get("output_dir"):
        raise ConfigurationError("profile= writes each host's jax.profiler trace to the job's "
                                 "output directory: pass output_dir='gs://bucket/prefix' or a "
                                 "local directory")
    if not get("init_jax"):
        raise ConfigurationError("profile= traces JAX: it needs init_jax=True")
    return float(secs)


def job_stem(text: str) -> str:
    """``text`` as the start of a job id: letters, digits, ``_.-``, at most 40."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:40].strip("-._") or "job"


def name(value: str | None, get: Get) -> str:
    """The start of the job ids of the function's calls; "" = its own name."""
    if value is None:
        return ""
    if not isinstance(value, str) or not _JOB_NAME.match(value):
        hint = f", e.g. {job_stem(value)!r}" if isinstance(value, str) else ""
        raise ConfigurationError(f"name={value!r}: a job name is 1 to 40 letters, digits, "
                                 f"'_', '.' or '-', starting with a letter, digit or '_'"
                                 f"{hint}")
    return value


# ---------------------------------------------------------------- a flag's text

def hosts_text(value: str) -> str | list[str] | None:
    """``--hosts a,b`` -> ``["a", "b"]``, ``--hosts a`` -> ``"a"``, ``""`` -> None
    (``$REMOTE_TPU_HOSTS``)."""
    entries = [h.strip() for h in value.split(",") if h.strip()]
    return entries[0] if len(entries) == 1 else (entries or None)


def name_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigurationError("write NAME=VALUE, e.g. XLA_FLAGS=--xla_dump_to=/tmp")
    return name, value


def requirement_args(values: list[str]) -> str | list[str]:
    """Repeated ``--requirements``: one existing file alone is passed as its
    path (errors name it); otherwise each value is a requirement line, or a
    file whose lines are taken."""
    if len(values) == 1 and os.path.isfile(values[0]):
        return values[0]
    lines: list[str] = []
    for value in values:
        if os.path.isfile(value):
            lines += requirement_lines(value, "--requirements ")
        elif value.endswith(".txt"):
            raise ConfigurationError(f"--requirements {value!r}: no such file; give a "
                                     "requirements file or a requirement such as "
                                     "'numpy>=2' (repeat the flag for several)")
        else:
            lines.append(value)
    return lines


def jax_timeouts_text(text: str) -> JaxTimeouts:
    """``heartbeat=60,shutdown=10`` (seconds; the others keep their defaults)."""
    keys = [f.name for f in dataclasses.fields(JaxTimeouts)]
    given: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key.strip() not in keys or not raw.strip().isdigit():
            raise ConfigurationError(f"write KEY=SECONDS[,KEY=SECONDS...] with KEY one of "
                                     f"{', '.join(keys)}, e.g. heartbeat=60,shutdown=10")
        given[key.strip()] = int(raw)
    return JaxTimeouts(**given)


def profile_text(text: str) -> bool | float:
    """``call`` (the whole call) or a number of seconds."""
    if text.strip().lower() == "call":
        return True
    try:
        return float(text)
    except ValueError:
        raise ConfigurationError("give 'call' (the whole call) or a number of seconds (its "
                                 "first ones)") from None
