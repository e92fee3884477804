"""The one table of ``remote_tpu.run()``'s options, and what derives from it.

Each option is declared once, in ``OPTIONS``: its name, type and default (as
``run()``'s signature writes them), its ``REMOTE_TPU_*`` variable, its check
(``_option_checks``), one line of help, the ``RunOptions`` field(s) it fills,
how it reaches the ``JobSpec`` and how it is given to ``remote-tpu run``. From
the table come: ``resolve`` (the checked ``RunOptions``), ``spec_fields`` (its
part of the ``JobSpec``, ``_client._spec``), the flags of ``remote-tpu run``
(``_cli_run``) and docs/options.md (``_options_doc``). ``run()`` keeps its
explicit keywords for IDEs and ``help()``; tests/unit/test_options.py holds them,
and its docstring's entries, to the table.

Precedence: explicit argument > ``REMOTE_TPU_*`` environment variable > default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import _option_checks as check
from ._core.auth import TLS
from ._core.addresses import Hosts
from ._core.exceptions import ConfigurationError
from ._core.topology import Topology
from ._option_checks import STREAM_MODES, JaxTimeouts  # noqa: F401 - re-exported

DOC_PAGE = "docs/options.md"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """``run()``'s options, checked: one field per option (two for ``hosts``),
    named in the table, and ``keep_going``, which only ``remote-tpu exec`` sets."""

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
    profile: float = 0.0              # seconds of jax.profiler trace (inf: the call); 0 = off
    all_results: bool = False         # every process's value, a list in process order
    compilation_cache: str = ""       # "" = the agent's own, "off", or gs://... / a host path
    stall_after: float = 0.0          # seconds; 0 = off (the check's default is on)
    on_stall: str = "report"          # or "cancel"
    name: str = ""                    # the start of its job ids; "" = the function's name
    keep_going: bool = False          # no fail-fast (`remote-tpu exec`)

    @property
    def local(self) -> bool:
        return self.hosts.local


@dataclasses.dataclass(frozen=True)
class Spec:
    """How an option reaches the ``JobSpec``: the fields it sets, and ``fill``
    (the checked options -> those fields' values). Without ``fill``, the call
    sets them (``_client._spec``) from what it sent or resolved, as ``by`` says."""

    fields: tuple[str, ...]
    fill: Callable[[RunOptions], dict[str, Any]] | None = None
    by: str = ""


@dataclasses.dataclass(frozen=True)
class Flag:
    """The option as a flag of ``remote-tpu run``: ``--NAME`` (with dashes)
    unless ``flag`` says otherwise. ``parse`` makes its text the keyword's
    value (a ConfigurationError it raises is said with the flag's name);
    ``many``: repeatable, and ``collect`` makes the list of parsed values the
    keyword's; ``switch``: a flag without a value, which gives that value;
    ``help``: its own, where the option's does not read right for the flag."""

    metavar: str = ""
    parse: Callable[[str], Any] = str
    flag: str = ""
    many: bool = False
    collect: Callable[[list[Any]], Any] = list
    switch: object = None
    choices: tuple[str, ...] = ()
    help: str = ""                  # where the option's own does not fit the flag


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword of ``remote_tpu.run()``.

    type, default: as ``run()``'s signature writes them.
    check: ``(value, get) -> checked value`` (``_option_checks``).
    help: one line, for ``remote-tpu run --help`` and docs/options.md.
    env: the variable read when the keyword is None; ``env_parse`` makes its
        text a value before the check (None: the check reads it itself).
    more_env: other variables it reads (documented; known to the misspelling
        warning).
    means: what the default means, where it is not plain (docs/options.md).
    fields: the ``RunOptions`` fields its check fills (default: its name).
    spec: how it reaches the ``JobSpec``; None: it stays on the client.
    flag: its ``remote-tpu run`` flag; None: none (tests/unit/test_options.py says why).
    """

    name: str
    type: str
    default: object
    check: Callable[[Any, Callable[[str], Any]], Any]
    help: str
    env: str = ""
    env_parse: Callable[[str], Any] | None = str
    more_env: tuple[str, ...] = ()
    means: str = ""
    fields: tuple[str, ...] = ()
    spec: Spec | None = None
    flag: Flag | None = None

    @property
    def targets(self) -> tuple[str, ...]:
        return self.fields or (self.name,)

    @property
    def variables(self) -> tuple[str, ...]:
        return ((self.env,) if self.env else ()) + self.more_env

    @property
    def cli(self) -> str:
        """Its flag on ``remote-tpu run`` ("" = none)."""
        if self.flag is None:
            return ""
        return self.flag.flag or "--" + self.name.replace("_", "-")


# ---------------------------------------------------------------- JobSpec fills

def _same(field: str, attr: str, convert: Callable[[Any], Any] = lambda v: v) -> Spec:
    return Spec((field,), lambda o: {field: convert(getattr(o, attr))})


def _topology_spec(o: RunOptions) -> dict[str, Any]:
    return {"accelerator": o.topology.name, "devices_per_host": o.topology.devices_per_host}


def _slices_spec(o: RunOptions) -> dict[str, Any]:
    return {"num_slices": o.num_slices, "num_hosts": o.topology.hosts * o.num_slices}


def _stream_spec(o: RunOptions) -> dict[str, Any]:
    from ._core.proto import remote_tpu_pb2 as pb

    return {"stream": {"leader": pb.STREAM_MODE_LEADER, "all": pb.STREAM_MODE_ALL,
                       "none": pb.STREAM_MODE_NONE}[o.stream]}


def _env_spec(o: RunOptions) -> dict[str, Any]:
    """``env=``, and the switch that shows the SDK's own frames where it is
    set here."""
    from ._core.user_source import SHOW_SDK_FRAMES, show_sdk_frames

    env = dict(o.env)
    if show_sdk_frames():
        env.setdefault(SHOW_SDK_FRAMES, os.environ[SHOW_SDK_FRAMES])
    return {"env": env}


def _jax_timeouts_spec(o: RunOptions) -> dict[str, Any]:
    from ._core.proto import remote_tpu_pb2 as pb

    jt = o.jax_timeouts
    return {"jax_timeouts": pb.JaxTimeouts(initialization_seconds=jt.initialization,
                                           heartbeat_seconds=jt.heartbeat,
                                           shutdown_seconds=jt.shutdown)}


def _output_dir_spec(o: RunOptions) -> dict[str, Any]:
    """A gs:// directory is written by every host; a local one is collected."""
    on_gcs = o.output_dir.startswith("gs://")
    return {"output_dir": o.output_dir if on_gcs else "",
            "collect_outputs": bool(o.output_dir) and not on_gcs}


# ---------------------------------------------------------------- the table

_SECONDS = "SECONDS"
OPTIONS: tuple[Option, ...] = (
    Option("accelerator", "str | Topology | None", None, check.accelerator,
           "Cloud TPU accelerator type, e.g. tpu-v5p-32",
           env="REMOTE_TPU_ACCELERATOR", means="required",
           fields=("topology",),
           spec=Spec(("accelerator", "devices_per_host"), _topology_spec),
           flag=Flag(metavar="TYPE")),
    Option("hosts", "str | Sequence[str] | None", None, check.hosts,
           "'local', an agent address of the slice, every host's address, or "
           "tpu://NAME?zone=ZONE",
           env="REMOTE_TPU_HOSTS", env_parse=None, means="'local' (a simulated slice)",
           fields=("hosts", "slices"),
           spec=Spec(("hosts",), by="the call, from the slice it reached"),
           flag=Flag(metavar="HOSTS", parse=check.hosts_text)),
    Option("timeout", "float | None", None, check.timeout,
           "seconds before the job is stopped on every host",
           env="REMOTE_TPU_TIMEOUT", env_parse=check.seconds, means="no limit",
           spec=_same("timeout_seconds", "timeout", lambda v: v or 0.0),
           flag=Flag(metavar=_SECONDS, parse=check.seconds)),
    Option("stream", "str | None", None, check.stream,
           "whose output is shown live: leader (process 0), all (every host) or none",
           env="REMOTE_TPU_STREAM", means="'leader'",
           spec=Spec(("stream",), _stream_spec),
           flag=Flag(choices=STREAM_MODES)),
    Option("env", "Mapping[str, str] | None", None, check.env,
           "environment variables for the function on every host",
           means="none", spec=Spec(("env",), _env_spec),
           flag=Flag(metavar="NAME=VALUE", parse=check.name_value, many=True,
                     collect=dict)),
    Option("jax_timeouts", "JaxTimeouts | None", None, check.jax_timeouts,
           "jax.distributed timeouts in seconds: initialization, heartbeat, shutdown",
           means="JaxTimeouts(initialization=120, heartbeat=20, shutdown=5)",
           spec=Spec(("jax_timeouts",), _jax_timeouts_spec),
           flag=Flag(metavar="KEY=SECONDS,...", parse=check.jax_timeouts_text,
                     help="jax.distributed timeouts in seconds, e.g. heartbeat=60,shutdown=10 "
                          "(keys: initialization, heartbeat, shutdown)")),
    Option("token", "str | None", None, check.token,
           "the slice's secret token",
           more_env=("REMOTE_TPU_TOKEN", "REMOTE_TPU_TOKEN_FILE"),
           means="$REMOTE_TPU_TOKEN, $REMOTE_TPU_TOKEN_FILE, then "
                 "~/.config/remote_tpu/token, for each call"),
    Option("tls", "TLS | None", None, check.tls,
           "remote_tpu.TLS(ca=..., cert=..., key=...) to verify the agents' certificate",
           more_env=("REMOTE_TPU_TLS_CA", "REMOTE_TPU_TLS_CERT", "REMOTE_TPU_TLS_KEY",
                     "REMOTE_TPU_TLS_SERVER_NAME"),
           means="from REMOTE_TPU_TLS_CA (and _CERT, _KEY, _SERVER_NAME), else none"),
    Option("processes_per_host", "int | None", None, check.processes_per_host,
           "JAX processes on each host, sharing its chips evenly",
           means="the accelerator's: 2 on TPU7x (GKE runs two JAX processes per VM), "
                 "else 1",
           spec=_same("processes_per_host", "processes_per_host"),
           flag=Flag(metavar="N", parse=check.whole)),
    Option("keep_warm", "float | None", None, check.keep_warm,
           "seconds every host's worker stays, jax.distributed up, for this process's "
           "next call",
           env="REMOTE_TPU_KEEP_WARM", env_parse=check.seconds, means="0 (off)",
           spec=_same("keep_warm_seconds", "keep_warm")),
    Option("init_jax", "bool", True, check.init_jax,
           "import jax and initialize jax.distributed in the worker (off: non-JAX work, "
           "which starts faster)",
           spec=_same("skip_jax_init", "init_jax", lambda v: not v),
           flag=Flag(flag="--no-jax", switch=False,
                     help="no jax.distributed in the worker (and no jax import of "
                          "its own; a spare worker may have imported jax already): "
                          "non-JAX work, which starts faster")),
    Option("working_dir", "str | os.PathLike | None", None, check.working_dir,
           "a project directory sent to every host and run in",
           env="REMOTE_TPU_WORKING_DIR", means="none",
           spec=Spec(("working_dir",), by="the call, once the gateway holds the tree"),
           flag=Flag(metavar="DIR")),
    Option("output_dir", "str | os.PathLike | None", None, check.output_dir,
           "gs://bucket/prefix or a local directory for every host's output files",
           env="REMOTE_TPU_OUTPUT_DIR", means="none",
           spec=Spec(("output_dir", "collect_outputs"), _output_dir_spec),
           flag=Flag(metavar="DIR")),
    Option("staging", "str | None", None, check.staging,
           "gs://bucket/prefix where local remote_tpu.Data arguments are uploaded once",
           env="REMOTE_TPU_STAGING", means="none (through the gateway)"),
    Option("requirements", "Sequence[str] | str | os.PathLike | None", None,
           check.requirements,
           "pip requirements (or a requirements file) for a virtual environment on "
           "every host",
           means="none", spec=_same("requirements", "requirements", list),
           flag=Flag(metavar="SPEC|FILE", many=True, collect=check.requirement_args)),
    Option("allow_jax_requirements", "bool", False, check.allow_jax_requirements,
           "allow requirements on jax, jaxlib, libtpu, cloudpickle or remote-tpu",
           spec=_same("allow_jax_requirements", "allow_jax_requirements"),
           flag=Flag(switch=True)),
    Option("retries", "int | Any", None, check.retries,
           "how many times a job is tried again after a preemption or a failure",
           env="REMOTE_TPU_RETRIES", env_parse=check.whole, means="none",
           spec=Spec(("retries", "earlier_attempts", "env"),
                     by="the call: a submitted job's policy, or an attended call's attempt "
                        "as REMOTE_TPU_ATTEMPT"),
           flag=Flag(metavar="N", parse=check.whole)),
    Option("num_slices", "int | None", None, check.num_slices,
           "run on this many slices of the accelerator, joined over the data-center "
           "network",
           env="REMOTE_TPU_NUM_SLICES", env_parse=check.whole, means="1",
           spec=Spec(("num_slices", "num_hosts"), _slices_spec),
           flag=Flag(metavar="N", parse=check.whole)),
    Option("profile", "bool | float", False, check.profile,
           "trace every host with jax.profiler into the output directory: the whole "
           "call, or its first seconds",
           spec=_same("profile_seconds", "profile"),
           flag=Flag(metavar="call|SECONDS", parse=check.profile_text)),
    Option("all_results", "bool | None", None, check.all_results,
           "return every process's value, a list in process order, instead of process "
           "0's (each other process's up to 64 MiB pickled)",
           env="REMOTE_TPU_ALL_RESULTS", env_parse=check.flag_text, means="False",
           spec=_same("all_results", "all_results")),
    Option("compilation_cache", "str | bool | None", None, check.compilation_cache,
           "JAX's persistent compilation cache on every host: a gs:// prefix or a path on "
           "the hosts, or False (off)",
           env="REMOTE_TPU_COMPILATION_CACHE", env_parse=check.compilation_cache_text,
           means="the agent's own bounded directory (remote-tpu-agent "
                 "--compilation-cache-bytes)",
           spec=_same("compilation_cache", "compilation_cache"),
           flag=Flag(metavar="gs://...|PATH|off", parse=check.compilation_cache_text)),
    Option("stall_after", "float | bool | None", None, check.stall_after,
           "seconds with no progress on any host (output, remote_tpu.progress(), CPU) "
           "before every process's stack is taken and the odd hosts named; False: off",
           env="REMOTE_TPU_STALL_AFTER", env_parse=check.stall_after_text,
           means=f"{check.DEFAULT_STALL_AFTER:g} s",
           spec=_same("stall_after_seconds", "stall_after"),
           flag=Flag(metavar="SECONDS|off", parse=check.stall_after_text)),
    Option("on_stall", "str | None", None, check.on_stall,
           "what a stall does: \"report\" (the job goes on) or \"cancel\" (it ends, the "
           "stall its cause)",
           env="REMOTE_TPU_ON_STALL", means='"report"',
           spec=Spec(("cancel_on_stall",), lambda o: {"cancel_on_stall": o.on_stall == "cancel"}),
           flag=Flag(metavar="report|cancel", choices=check.ON_STALL)),
    Option("name", "str | None", None, check.name,
           "the job's name, the start of its job id",
           means="the function's name",
           spec=Spec(("job_id",), by="the call: NAME-<12 hex digits>, new for each call"),
           flag=Flag(metavar="NAME")),
)
BY_NAME: Mapping[str, Option] = {o.name: o for o in OPTIONS}
# RunOptions fields that no option of run() fills.
NOT_OPTIONS = ("keep_going",)


def spec_fields(options: RunOptions) -> dict[str, Any]:
    """The ``JobSpec`` fields the options fill themselves (``Spec.fill``)."""
    out: dict[str, Any] = {}
    for option in OPTIONS:
        if option.spec is not None and option.spec.fill is not None:
            out.update(option.spec.fill(options))
    return out


# ---------------------------------------------------------------- variables

def _from_env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


# Every REMOTE_TPU_* variable remote_tpu reads or sets, on a client, an agent or
# in a worker (tests/unit/test_options.py checks the code names no other): the
# options' (from the table) and these.
OTHER_VARIABLES = frozenset({
    "REMOTE_TPU_REQUIRE_TLS", "REMOTE_TPU_TPU_API", "REMOTE_TPU_SHOW_SDK_FRAMES",
    "REMOTE_TPU_DEPS", "REMOTE_TPU_PYTHON", "REMOTE_TPU_AGENT_LOG", "REMOTE_TPU_UP_POLL_SECONDS",
    # set by an agent for its workers and the function (and REMOTE_TPU_ACCELERATOR)
    "REMOTE_TPU_JOB_ID", "REMOTE_TPU_HOST_INDEX",
    "REMOTE_TPU_PROCESS_INDEX", "REMOTE_TPU_NUM_HOSTS", "REMOTE_TPU_SLICE_ID",
    "REMOTE_TPU_ATTEMPT", "REMOTE_TPU_JOB_DIR", "REMOTE_TPU_SHARED_OUTPUT_DIR",
    "REMOTE_TPU_GCS_CACHE", "REMOTE_TPU_PROFILE", "REMOTE_TPU_INIT_JAX",
    "REMOTE_TPU_SIMULATE_DEVICES", "REMOTE_TPU_STATUS_FD", "REMOTE_TPU_CONTROL_FD",
    "REMOTE_TPU_JAX_INIT_TIMEOUT", "REMOTE_TPU_JAX_HEARTBEAT_TIMEOUT",
    "REMOTE_TPU_JAX_SHUTDOWN_TIMEOUT",
})
KNOWN_VARIABLES = OTHER_VARIABLES | {v for o in OPTIONS for v in o.variables}
_warned_variables: set[str] = set()


def warn_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """Warn once per name of a set ``REMOTE_TPU_*`` variable that nothing
    reads (a misspelt one is otherwise silently ignored), with the nearest."""
    for name in sorted(environ):
        if not name.startswith("REMOTE_TPU_") or name in KNOWN_VARIABLES or \
                name in _warned_variables:
            continue
        _warned_variables.add(name)
        # (Matched without the prefix all of them share, which would make
        # any two long enough names look alike.)
        tails = {v.removeprefix("REMOTE_TPU_"): v for v in KNOWN_VARIABLES}
        near = [tails[t] for t in difflib.get_close_matches(
            name.removeprefix("REMOTE_TPU_"), tails, n=1, cutoff=0.75)]
        warnings.warn(f"{name} is set but remote_tpu reads no such variable"
                      + (f": did you mean {near[0]}?" if near else
                         f"; see {DOC_PAGE} for the ones it reads"),
                      UserWarning, stacklevel=check.user_stacklevel())


@contextlib.contextmanager
def _variable(explicit: object, name: str) -> Iterator[None]:
    """An error in a value taken from the variable ``name`` (``explicit``
    None) names the variable, so the user knows where it came from."""
    raw = _from_env(name) if explicit is None and name else None
    try:
        yield
    except ConfigurationError as exc:
        if raw is None or name in str(exc) or getattr(exc, "option_said", False):
            raise                 # (said already, by the option whose check it is)
        said = str(exc).rstrip(".")
        raise ConfigurationError(f"{name}={raw!r} (from the environment): {said}; fix or "
                                 f"unset {name}") from None


# ---------------------------------------------------------------- resolving

class _Resolving:
    """The options of one ``run()`` being checked: each in the table's order,
    or sooner when another's check asks for it (``get``)."""

    def __init__(self, given: Mapping[str, object]) -> None:
        unknown = sorted(set(given) - set(BY_NAME))
        if unknown:
            raise ConfigurationError(f"remote_tpu.run has no option {', '.join(unknown)}; "
                                     f"see {DOC_PAGE}")
        self.given = given
        self.done: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self.done:
            option = BY_NAME[name]
            value = self.given.get(name, option.default)
            try:
                with _variable(value, option.env):
                    if value is None and option.env and option.env_parse is not None:
                        raw = _from_env(option.env)
                        value = None if raw is None else option.env_parse(raw)
                    self.done[name] = option.check(value, self.get)
            except ConfigurationError as exc:
                exc.option_said = True    # an option whose check asked for this one
                raise                     # does not claim its error
        return self.done[name]

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for option in OPTIONS:
            value = self.get(option.name)
            out.update(zip(option.targets, value) if len(option.targets) > 1 else
                       {option.targets[0]: value})
        return out


def resolve(given: Mapping[str, object] | None = None, /, **keywords: object) -> RunOptions:
    """The checked options of ``run(**given)`` (omitted ones: their defaults)."""
    warn_unknown_variables()
    return RunOptions(**_Resolving({**(given or {}), **keywords}).fields())
