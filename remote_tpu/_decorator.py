"""``@remote_tpu.run(...)``: the decorator and the function it returns."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

from ._core.auth import TLS
from ._core.serialization import Payload
from ._core.exceptions import ConfigurationError
from ._core.user_source import cut_sdk_frames
from ._futures import CallJob
from ._jobs import JobHandle
from ._options import JaxTimeouts, RunOptions, resolve
from ._core.topology import Topology

P = ParamSpec("P")
R = TypeVar("R")


class RemoteFunction(Generic[P, R]):
    """A function that runs on every host of a slice when called.

    Calling it blocks until every host has finished and returns process 0's
    value, or re-raises the root-cause host's exception, which carries the
    job's id as ``job_id``. ``await fn.aio(...)`` is the same call awaited,
    ``.submit(...)`` returns a ``JobHandle`` at once, ``last_job``
    is the handle of the latest call's job (set once its id is known, so also
    after a call raised or was interrupted; None before any call), and
    ``.local(...)`` calls the plain function in this process.
    """

    def __init__(self, fn: Callable[P, R], options: RunOptions) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.options = options
        self.last_job: JobHandle | None = None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        __tracebackhide__ = True        # IPython: the user's cell, not the SDK
        job = CallJob(self._handle)
        try:
            return self._call(args, kwargs, job)
        except (Exception, KeyboardInterrupt) as exc:
            raise cut_sdk_frames(job.tagged(exc))

    async def aio(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """The call, awaited: as calling the function (output shown live, the
        value returned, the remote exception raised again), in a thread of its
        own, so the event loop (a notebook's too) goes on meanwhile. If the
        awaiting task is cancelled, the job is cancelled on every host."""
        __tracebackhide__ = True
        from ._futures import awaited, in_thread

        job = CallJob(self._handle)
        running = in_thread(lambda: self._call(args, kwargs, job),
                            name=f"remote_tpu call {self._name}")
        try:
            return await awaited(running, lambda: job.cancel(running))
        except (Exception, KeyboardInterrupt) as exc:
            raise cut_sdk_frames(job.tagged(exc))

    def _handle(self, job_id: str, target: Any) -> JobHandle:
        """A call's job, as soon as its id is known: ``last_job``."""
        self.last_job = JobHandle(job_id, target, accelerator=self.options.topology.name,
                                  output_dir=self.options.output_dir)
        return self.last_job

    def _call(self, args: tuple, kwargs: dict, job: CallJob) -> R:
        from ._client import call, new_job_id

        from ._retries import run as with_retries

        payload = self._payload(args, kwargs)          # fails here, before sending
        return with_retries(self.options.retries,
                            lambda attempt, earlier: call(self.options, payload,
                                                          new_job_id(self._name), attempt,
                                                          earlier, started=job.started))

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        """Start the job and return its handle at once; it keeps running when
        this process ends (except on a local slice, which ends with it)."""
        __tracebackhide__ = True
        from ._client import new_job_id, submit

        try:
            payload = self._payload(args, kwargs)
            self.last_job = submit(self.options, payload, new_job_id(self._name))
            return self.last_job
        except (Exception, KeyboardInterrupt) as exc:
            raise cut_sdk_frames(exc)

    @property
    def _name(self) -> str:
        """The start of its calls' job ids: ``name=``, else the function's name."""
        return self.options.name or getattr(self._fn, "__name__", "job")

    def _payload(self, args: tuple, kwargs: dict) -> Payload:
        """The pickled call, its large buffers apart (``_blobs``); ``inline()``
        pickles it again with them inside, for a slice that cannot cache them."""
        from ._blobs import BLOB_MIN
        from ._core.serialization import dumps_call
        from ._data import collecting

        def pickled(blob_min: int | None) -> Payload:
            with collecting(self.options.staging) as met:  # its remote_tpu.Data, as met
                payload = dumps_call(self._fn, args, kwargs, blob_min=blob_min)
            payload.data = met
            return payload

        payload = pickled(BLOB_MIN)
        payload.inline = lambda: pickled(None)
        return payload

    def release(self) -> bool:
        """End this function's slice's warm workers now (``keep_warm``); whether
        there were any. The next call starts fresh workers."""
        from ._jobs import release_targets
        from ._target import running_targets

        o = self.options
        return any(released for released, _ in release_targets(running_targets(
            o.hosts, topology=o.topology, token=o.token, tls=o.tls)))

    def local(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the undecorated function in this process."""
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        o = self.options
        where = "local slice" if o.local else ", ".join(o.hosts.entries)
        if o.num_slices > 1:
            where = (f"{o.num_slices} local slices" if o.local else
                     " | ".join(", ".join(s.entries) for s in o.slices))
        return f"<remote_tpu function {self.__qualname__} on {o.topology.name} ({where})>"


def run(fn: Callable[..., Any] | None = None, /, *,
        accelerator: str | Topology | None = None,
        hosts: str | Sequence[str] | None = None,
        timeout: float | None = None,
        stream: str | None = None,
        env: Mapping[str, str] | None = None,
        jax_timeouts: JaxTimeouts | None = None,
        token: str | None = None,
        tls: TLS | None = None,
        processes_per_host: int | None = None,
        keep_warm: float | None = None,
        init_jax: bool = True,
        working_dir: str | os.PathLike | None = None,
        output_dir: str | os.PathLike | None = None,
        staging: str | None = None,
        requirements: Sequence[str] | str | os.PathLike | None = None,
        allow_jax_requirements: bool = False,
        retries: int | Any = None,
        num_slices: int | None = None,
        profile: bool | float = False,
        all_results: bool | None = None,
        compilation_cache: str | bool | None = None,
        stall_after: float | bool | None = None,
        on_stall: str | None = None,
        name: str | None = None,
        ) -> Callable[[Callable[P, R]], RemoteFunction[P, R]]:
    """Run the decorated function on every host of a TPU slice.

    accelerator: Cloud TPU accelerator type, e.g. ``"tpu-v5p-32"``
        (``REMOTE_TPU_ACCELERATOR``).
    hosts: ``"local"`` (a simulated slice on this machine), one agent address
        ``"ip[:port]"`` (the gateway, which knows its peers), or a list of every
        host's agent address, first = gateway, or the same as one string, comma
        separated (``REMOTE_TPU_HOSTS``; default ``"local"``).
    timeout: seconds before the job is stopped on every host (``REMOTE_TPU_TIMEOUT``).
    stream: ``"leader"`` (process 0's output, the default), ``"all"`` (every host,
        prefixed ``[host i]``) or ``"none"`` (``REMOTE_TPU_STREAM``).
    env: environment variables to set for the function on every host.
    jax_timeouts: ``jax.distributed`` initialization/heartbeat/shutdown timeouts.
    token: the slice's secret token (default: ``$REMOTE_TPU_TOKEN``,
        ``$REMOTE_TPU_TOKEN_FILE``, then ``~/.config/remote_tpu/token``).
    tls: ``remote_tpu.TLS(ca=..., cert=..., key=...)`` to verify the agent's
        certificate (``REMOTE_TPU_TLS_CA``, ``_CERT``, ``_KEY``).
    processes_per_host: JAX processes on each host, sharing its chips evenly
        (process id = host * processes_per_host + k); default: 2 on TPU7x, as
        GKE runs it, else 1.
    keep_warm: seconds to keep every host's worker alive, ``jax.distributed``
        initialized, after a call (``REMOTE_TPU_KEEP_WARM``; default 0 = off).
        This process's next call with the same slice and worker-shaping options
        runs in the same processes and finds ``remote_tpu.state`` as the last
        call left it; other callers' jobs wait. ``fn.release()`` ends them.
    init_jax: False for a function that does not use JAX (installing a package,
        fetching data on every host): the worker does not initialize
        ``jax.distributed``, and a freshly started one does not import jax (a
        spare worker started ahead of the job may have), so it starts in a
        fraction of the time.
    working_dir: a project directory sent to every host (``REMOTE_TPU_WORKING_DIR``):
        the function runs in its copy there, which is also on ``sys.path``.
        ``.gitignore`` files and a ``.remote_tpu_ignore`` leave files out; at
        most 512 MiB; only files a host lacks are sent, so an unchanged tree
        costs nothing on the next call. Each call starts from the tree as sent
        (what a call wrote there is gone): write outputs elsewhere.
    output_dir: ``gs://bucket/prefix`` or a local directory
        (``REMOTE_TPU_OUTPUT_DIR``): each process writes to
        ``remote_tpu.output_dir()`` (its own, saved under ``host_{i}/``) or
        ``remote_tpu.output_dir(shared=True)`` (saved at the top), and the files
        land in ``{output_dir}/{job_id}/``: uploaded to GCS by each host while
        the job runs (every 30 s, and as each process ends, failed ones too), or
        brought back to this machine's directory when the call ends
        (``handle.outputs()`` for a submitted job).
    staging: ``gs://bucket/prefix`` (``REMOTE_TPU_STAGING``): local
        ``remote_tpu.Data`` arguments are uploaded there once, under their
        digest, and every host downloads them from there; without it they go
        through the gateway, by content.
    requirements: pip requirement strings, or a requirements file's path: each
        host makes a virtual environment with them (once per host and set of
        requirements, the installer's output shown), layered on its own Python
        so its jax and libtpu stay; the workers run in it. A requirement on jax,
        jaxlib, libtpu, cloudpickle or remote-tpu is refused unless
        ``allow_jax_requirements=True``.
    allow_jax_requirements: True lets ``requirements`` name jax, jaxlib,
        libtpu, cloudpickle or remote-tpu, and lets the installer change the
        host's own versions of them (held otherwise) in the job's environment:
        they must still fit the TPU and the client.
    retries: an int (retries after an end of either kind) or
        ``remote_tpu.Retries(preemptions=100, failures=0, backoff=10)``
        (``REMOTE_TPU_RETRIES``): a preemption (a host's VM preempted or gone,
        its agent restarted) and a failure of the function (it raised, its
        worker died, it timed out) are counted apart. Each attempt is a new job
        with ``REMOTE_TPU_ATTEMPT`` (0, 1, ...) set, to resume from a checkpoint;
        each retry is said on stderr; the last error carries the earlier
        attempts' causes. A call that waits for its value is tried again by
        this process (which also tries again when the gateway itself is gone); a
        submitted job by its gateway, under the same job id
        (``handle.status().attempts`` lists the attempts that ended).
    num_slices: run on this many slices of ``accelerator`` joined over the
        data-center network (``REMOTE_TPU_NUM_SLICES``; default 1). ``hosts``
        then names one slice per entry, slice 0 first (each in any form above),
        or ``"local"`` (simulated), or one ``"tpu://PREFIX?zone=..."`` (the
        nodes PREFIX-0, PREFIX-1, ... of a multislice queued resource). Every
        host gets ``MEGASCALE_NUM_SLICES``, ``MEGASCALE_SLICE_ID``,
        ``MEGASCALE_COORDINATOR_ADDRESS`` (slice 0's worker 0) and
        ``MEGASCALE_PORT`` (8081; ``env=`` may change it); process ids go slice
        by slice (slice * hosts per slice + host).
    profile: True (the whole call) or a number of seconds (its first ones):
        every host traces the call with ``jax.profiler`` into its output
        directory (needs ``output_dir=``): the traces land in
        ``{output_dir}/{job_id}/host_{i}/plugins/profile/``, for TensorBoard or
        XProf; the call says where when it ends.
    all_results: True to get every process's return value, a list in process
        order (per-host metrics, say), instead of process 0's alone
        (``REMOTE_TPU_ALL_RESULTS``). Each value but process 0's may be up to
        64 MiB pickled; a larger one fails its process with a message that
        says so.
    compilation_cache: where JAX's persistent compilation cache is, on every
        host (``REMOTE_TPU_COMPILATION_CACHE``): by default a directory of the
        agent's own, bounded (``remote-tpu-agent --compilation-cache-bytes``),
        so that a cold call's compilations are paid once; a ``gs://`` prefix
        (shared by every host and slice; the hosts' jax must be able to write
        it) or an absolute path on the hosts instead; False: off.
    stall_after: seconds with no progress on any host (no output, no
        ``remote_tpu.progress()``, no CPU used by any worker) before every
        process's Python stack is taken at once, grouped, and the hosts whose
        stack differs from the others' named, with the frames where it
        differs: printed to the caller and kept with the job
        (``remote-tpu jobs stalls JOB``). Default 300; 0 or False: off
        (``REMOTE_TPU_STALL_AFTER``).
    on_stall: ``"report"`` (the default: the job goes on) or ``"cancel"`` (the
        stall ends the job, the odd host its root cause) (``REMOTE_TPU_ON_STALL``).
    name: the job's name: its job ids are ``NAME-`` and 12 hex digits, new for
        each call (default: the function's name). Letters, digits, ``_``,
        ``.`` and ``-``, at most 40.

    Every option, with its variable and its ``remote-tpu run`` flag, is listed
    in docs/options.md (generated from the table in ``remote_tpu._options``).
    """
    given = dict(locals())         # the keywords, as the table names them
    del given["fn"]
    if fn is not None:
        raise ConfigurationError(
            "remote_tpu.run must be called with its options: write "
            "@remote_tpu.run(accelerator='tpu-v4-16', hosts='local'), with parentheses, "
            f"above {getattr(fn, '__qualname__', fn)!r}")
    options = resolve(given)

    def decorate(f: Callable[P, R]) -> RemoteFunction[P, R]:
        if not callable(f):
            raise ConfigurationError(f"remote_tpu.run decorates a function, got {f!r}")
        return RemoteFunction(f, options)

    return decorate
