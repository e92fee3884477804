"""The worker: runs in a child process of the agent, one per host and job (or
warm session).

It waits for its call on the control pipe (``worker.frames``: the call's
directory, environment and payload), initializes ``jax.distributed``, loads and
calls the function, and sends the outcome back on the status pipe (process 0's
pickled value with it, or in a file when large). Then it waits until the agent
releases it (every host has finished, so no peer can still need this process
for a collective, and process 0 keeps JAX's coordination service up until the
end). It leaves with ``os._exit`` and never waits in JAX's shutdown. If the
agent goes away (its end of the control pipe closes) the worker kills its whole
process group.

A warm call (its CALL frame says ``warm``, for ``keep_warm``) leaves the worker
alive after it: it waits for the next call of the same slice and runs it in the
same process, ``jax.distributed`` still initialized and ``remote_tpu.state`` as
the last call left it, until the agent releases it or goes away.

A spare (``--spare``, ``worker.spares``) is started before its job: it imports jax and
waits for its first call like any worker; its process is named ``rtpu-spare``
until then and ``rtpu-worker`` after (as ``ps`` shows it).
"""

from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time

from remote_tpu_agent.worker import child_output as _worker_output
from remote_tpu_agent.worker import frames as wire

ENV_JOB_DIR = "REMOTE_TPU_JOB_DIR"            # the worker's own files (stacks)
ENV_CONTROL_FD = "REMOTE_TPU_CONTROL_FD"      # agent -> worker frames (worker.frames)
ENV_STATUS_FD = "REMOTE_TPU_STATUS_FD"        # worker -> agent frames
ENV_SIMULATE_DEVICES = "REMOTE_TPU_SIMULATE_DEVICES"
ENV_INIT_TIMEOUT = "REMOTE_TPU_JAX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "REMOTE_TPU_JAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "REMOTE_TPU_JAX_SHUTDOWN_TIMEOUT"
ENV_INIT_JAX = "REMOTE_TPU_INIT_JAX"          # "0": init_jax=False (no jax at all)
ENV_ALL_RESULTS = "REMOTE_TPU_ALL_RESULTS"    # "1": every process's value is sent
ENV_PYTHON = "REMOTE_TPU_PYTHON"              # requirements=: the environment's interpreter

_START_DIR = os.getcwd()
PAYLOAD_FILE = "payload.bin"
STACKS_FILE = "stacks.txt"      # SIGUSR1 appends every thread's Python stack here
STACKS_SIGNAL = signal.SIGUSR1
RESULT_FILE = "result.bin"
EXCEPTION_FILE = "exception.txt"   # the whole traceback, when the report had to cut it


def _next_order(fd: int) -> tuple | None:
    """The agent's next order, read by the main thread: a call's frame, or
    None to exit (release). The agent gone (or its pipe garbled): nothing of
    this job may outlive it."""
    frame = wire.read_frame(fd)
    if frame is not None and frame[0] == wire.RELEASE:
        return None
    if frame is not None and frame[0] == wire.CALL:
        return frame
    _agent_gone(b"ended" if frame is None else b"sent an unknown frame")
    raise AssertionError("unreachable")


def _agent_gone(how: bytes) -> None:
    try:
        os.write(2, b"\n[remote_tpu: the worker's control pipe from the agent " + how
                 + b"; the worker stops]\n")
    except OSError:
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _order(fd: int, watch: _ControlWatch) -> tuple | None:
    """The next order, read with the watch off (a release leaves it off: the
    agent may close the pipe as this process exits)."""
    watch.away.clear()
    frame = _next_order(fd)
    if frame is not None:
        watch.away.set()
    return frame


class _ControlWatch(threading.Thread):
    """While the main thread is not reading the control pipe (a call runs, or
    jax is being imported), the agent's end closing kills the process group:
    this thread polls the pipe for its end only (it never reads it, so the
    main thread takes each order itself, with no hand-off between threads)."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True, name="remote-tpu-control")
        self._fd = fd
        self.away = threading.Event()          # set: the main thread is not reading

    def run(self) -> None:
        poll = select.poll()
        poll.register(self._fd, select.POLLHUP | select.POLLERR)
        while True:
            if poll.poll() and self.away.is_set():
                _agent_gone(b"ended")
            # The main thread reads: it sees the end itself (now, or in a moment).
            self.away.wait()
            time.sleep(0.05)


def _await_coordinator(address: str, timeout: float) -> None:
    """Wait until process 0's coordination service accepts connections: a peer
    that connects too early pays JAX's retry backoff (~0.7 s). Importing jax
    before this runs in parallel with process 0 doing the same."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.01)


def _wants_jax() -> bool:
    """Whether this worker's job uses JAX (``init_jax=False`` says not)."""
    return os.environ.get(ENV_INIT_JAX, "1") != "0"


def _initialize_jax(process_id: int, num_processes: int) -> None:
    import jax

    devices = int(os.environ.get(ENV_SIMULATE_DEVICES, "0") or 0)
    if devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
    coordinator = os.environ["JAX_COORDINATOR_ADDRESS"]
    init_timeout = int(os.environ.get(ENV_INIT_TIMEOUT, "120"))
    if process_id != 0:
        _await_coordinator(coordinator, init_timeout)
    real_initialize = jax.distributed.initialize
    real_initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=init_timeout,
        heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT_TIMEOUT, "20")),
        shutdown_timeout_seconds=int(os.environ.get(ENV_SHUTDOWN_TIMEOUT, "5")),
    )

    def initialize(*args: object, **kwargs: object) -> None:
        """Already initialized by remote_tpu for this slice: nothing to do."""

    # Existing scripts call jax.distributed.initialize() themselves.
    jax.distributed.initialize = initialize


def _user_traceback(exc: BaseException) -> str:
    """The traceback in the user's terms (``user_source``): their frames,
    files and cells, not the SDK's."""
    from remote_tpu._core.user_source import format_exception
    return format_exception(exc, working_dir=_working_dir)


def private(path: str, flags: int) -> int:
    """Open for ``os.fdopen``: files of a job are its owner's only (0600)."""
    return os.open(path, flags, 0o600)


def _describe_failure(exc: BaseException, process_id: int, job_dir: str) -> dict:
    """The exception for the outcome file, cut to what a report can carry. The
    whole traceback goes to a file of the job on this host, which a cut text
    names (not to the output: a retry loop around a huge exception would flood
    its caller)."""
    from remote_tpu._core.remote_exceptions import describe_exception

    path = os.path.join(job_dir, EXCEPTION_FILE)
    where = f"the whole text is in {path} on host {process_id}"
    full = _user_traceback(exc)
    info = describe_exception(exc, traceback_text=full, where=where)
    try:
        os.makedirs(job_dir, mode=0o700, exist_ok=True)       # made on first need
        with open(path, "w", errors="backslashreplace", opener=private) as f:
            f.write(full)
    except OSError as err:
        if info["cut"]:
            info["message"] += f"\n[remote_tpu: could not write {path}: {err.strerror}]"
    return info


def _flush_output(close: bool) -> None:
    """Flush what the user's code printed (Python's and C's buffers), so the
    agent has it all before it reads the outcome; with ``close``, also close
    our ends of the output pipes (a worker that exits after this call)."""
    _worker_output.flush()
    if not close:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _failed(exc: BaseException, phase: str, process_id: int, job_dir: str) -> dict:
    info = _describe_failure(exc, process_id, job_dir)
    return {"state": "failed", "phase": phase, "failed_at": time.time(),
            "exception": {**info, "pickled": info["pickled"].hex()}}


def _load(header: dict, blob: bytes) -> bytearray:
    """The call's payload: inline, or read from the file the header names (not
    mapped: a warm session's next call is written to the same file; its large
    buffers, which are mapped, come apart: ``_map_blobs``)."""
    if not header.get("payload_path"):
        return bytearray(blob)
    with open(header["payload_path"], "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return data


def _map_blobs(header: dict) -> list[mmap.mmap]:
    """The call's large buffers, from the agent's argument cache, mapped
    copy-on-write (the agent checked each against its digest as it arrived;
    a cache file is never rewritten, only replaced or removed, so a mapping
    stays as it was): arrays unpickled from them use those pages, no copy,
    and stay writable."""
    maps = []
    for path in header.get("blobs", ()):
        with open(path, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
    return maps


def _write_result(payload, header: dict) -> str:
    """Write a large value: in memory where the agent has a place for it (it
    moves it to the job's directory while the caller already reads it), in
    the job's directory when that place is full or missing. Its path."""
    places = [os.path.join(header["job_dir"], RESULT_FILE)]
    if header.get("result_dir"):
        places.insert(0, os.path.join(header["result_dir"],
                                      os.path.basename(header["job_dir"]) + ".result"))
    for i, path in enumerate(places):
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(path, "wb", opener=private) as f:
                for part in payload.parts:
                    f.write(part)
            return path
        except OSError:
            try:
                os.unlink(path)
            except OSError:
                pass
            if i == len(places) - 1:
                raise
    raise AssertionError("unreachable")


_working_dir = ""          # the last call's working_dir= copy on this host


def _enter_working_dir(path: str) -> None:
    """working_dir=: the call runs in its copy of the tree, first on sys.path.
    A warm worker leaving one tree for another (or none) forgets the modules
    it imported from the old one, so the new tree's own are imported."""
    global _working_dir
    old, _working_dir = _working_dir, path
    if old and old != path:
        while old in sys.path:
            sys.path.remove(old)
        for name, module in list(sys.modules.items()):
            try:
                where = getattr(module, "__file__", None) or ""
            except Exception:  # noqa: BLE001 - a lazy module's own __getattr__
                continue
            if isinstance(where, str) and where.startswith(old + os.sep):
                del sys.modules[name]
    if path:
        if path not in sys.path:
            sys.path.insert(0, path)
        os.chdir(path)
    elif old:
        os.chdir(_START_DIR)


class _interruptible:
    """While the user's function runs, SIGINT (a warm caller's first Ctrl-C,
    sent by the agent: ``CONTROL_INTERRUPT``) raises KeyboardInterrupt in it,
    as Ctrl-C does in a notebook; anywhere else the worker ignores it."""

    def __enter__(self) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_call(header: dict, blob: bytes, process_id: int) -> tuple[dict, bytes]:
    """One call: load the function, call it, keep process 0's value (every
    process's, for ``all_results=``). Returns the outcome for the agent, and
    the pickled value when it goes inline."""
    from remote_tpu._core import digests
    from remote_tpu._core import serialization as _serialization
    from remote_tpu._core.limits import OTHER_VALUE_BYTES

    outcome: dict = {"state": "succeeded"}
    result = b""
    phase = "entering the working_dir"
    try:
        _enter_working_dir(header.get("working_dir", ""))
        from remote_tpu._core import data_paths
        data_paths.placed.clear()
        data_paths.placed.update(header.get("data", {}))
        data_paths.fetched.clear()
        for uri in header.get("gcs_data", ()):
            phase = f"fetching remote_tpu.Data({uri!r}) to this host"
            data_paths.fetched[uri] = data_paths.fetch(uri)
        phase = "loading the function and its arguments"
        data = _load(header, blob)
        if digests.of(data).hex() != header.get("digest"):
            raise _serialization.SerializationError(
                "the payload on this host does not match the digest the client sent; "
                "nothing was unpickled")
        fn, args, kwargs = _serialization.loads_call(data, external=_map_blobs(header))
        del data
        phase = "running the function"
        from remote_tpu_agent.worker import profile as _profile
        with _interruptible():
            value = _profile.call(fn, args, kwargs)
        if process_id == 0 or os.environ.get(ENV_ALL_RESULTS) == "1":
            phase = "pickling the return value"
            payload = _serialization.dumps(value, what="the return value")
            if process_id and payload.nbytes > OTHER_VALUE_BYTES:
                raise _serialization.SerializationError(
                    f"all_results=: process {process_id}'s return value is "
                    f"{payload.nbytes:,} bytes pickled; each process but process 0 may "
                    f"return up to {OTHER_VALUE_BYTES:,}: return a summary (write large "
                    "data to remote_tpu.output_dir())")
            outcome["result_digest"] = payload.digest().hex()
            if payload.nbytes <= wire.INLINE_BYTES:
                result = payload.to_bytes()
            else:
                outcome["result_file"] = _write_result(payload, header)
        del value
    except BaseException as exc:  # noqa: BLE001 - everything is reported
        outcome = _failed(exc, phase, process_id, header["job_dir"])
        result = b""
    return outcome, result


def _name_process(name: str) -> None:
    """The name ``ps`` and /proc show for this process (Linux; elsewhere none)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)     # PR_SET_NAME
    except (OSError, AttributeError):
        pass


_status_lock = threading.Lock()     # DONE (main thread) and PROGRESS (any thread)


def _report_progress_to(status_fd: int) -> None:
    """``remote_tpu.progress()`` in this process: a PROGRESS frame to the agent."""
    from remote_tpu._core import progress

    def sink(step: int | None) -> None:
        with _status_lock:
            wire.write_frame(status_fd, wire.PROGRESS, {} if step is None else {"step": step})

    def forked() -> None:           # a fork's copy of the lock may be held
        global _status_lock
        _status_lock = threading.Lock()
        progress.forget_in_child()
    os.register_at_fork(after_in_child=forked)
    progress._sink = sink


def main() -> None:
    job_dir = os.environ[ENV_JOB_DIR]
    control_fd = int(os.environ[ENV_CONTROL_FD])
    status_fd = int(os.environ[ENV_STATUS_FD])
    for fd in (control_fd, status_fd):    # not for the user's own subprocesses
        os.set_inheritable(fd, False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # but in the function: _interruptible
    _worker_output.buffer_output()

    # On demand (and on timeout) the agent asks where every thread is; this works
    # even while the main thread is stuck inside a C call or a collective.
    stacks_file = open(os.path.join(job_dir, STACKS_FILE), "a", opener=private)
    faulthandler.register(STACKS_SIGNAL, file=stacks_file, all_threads=True)
    wire.write_frame(status_fd, wire.READY)
    _report_progress_to(status_fd)

    watch = _ControlWatch(control_fd)
    watch.away.set()
    watch.start()
    _name_process("rtpu-spare" if "--spare" in sys.argv else "rtpu-worker")
    if _wants_jax():
        import jax  # noqa: F401 - while the first call is on its way (it does not take the TPU)

    # Likewise what every call needs: a spare's call then pays for none of it.
    from remote_tpu._core import data_paths, local_modules, serialization, versions  # noqa: F401
    from remote_tpu_agent.worker import profile  # noqa: F401

    versions.local_versions()   # (reading the packages' metadata: ~10 ms)
    local_modules.warm()        # (process 0 pickles its value with it: ~1.5 ms)

    frame = _order(control_fd, watch)
    _worker_output.resume()     # (its flusher rests until the first call: ``buffer_output``)
    _name_process("rtpu-worker")
    failure, initialized = None, False
    while frame is not None:
        _, header, blob = frame
        warm = bool(header.get("warm"))
        os.environ.update(header.get("env", {}))
        if failure is None and not initialized and _wants_jax():
            try:
                _initialize_jax(int(os.environ["JAX_PROCESS_ID"]),
                                int(os.environ["JAX_NUM_PROCESSES"]))
                initialized = True
                with _status_lock:
                    wire.write_frame(status_fd, wire.JAX_READY)
            except BaseException as exc:  # noqa: BLE001 - reported as the call's outcome
                failure = _failed(exc, "initializing jax.distributed",
                                  int(os.environ.get("JAX_PROCESS_ID", "0")), header["job_dir"])
        if failure is not None:
            outcome, result = failure, b""
        else:
            outcome, result = _run_call(header, blob, int(os.environ["JAX_PROCESS_ID"]))
        del blob, frame
        _flush_output(close=not warm or failure is not None)
        with _status_lock:
            wire.write_frame(status_fd, wire.DONE, outcome, result)
        del result
        frame = _order(control_fd, watch)
    os._exit(0)


if __name__ == "__main__":
    main()
