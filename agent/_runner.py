"""Runs one worker subprocess for one job on this host and reports on it.

A :class:`WorkerRun` spawns the worker in its own process group, forwards its
stdout/stderr (read at the file-descriptor level, so output from C and XLA is
caught too), reads its outcome, and emits ``Event`` messages: ``started``,
``output``, ``done`` (the function finished) and finally ``exited`` (the process
is gone), whose report is the host's final state.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

from remote_tpu._proto import remote_tpu_pb2 as pb

from . import _worker
from ._output import NoiseFilter, Tail
from ._process import signal_name, stop_group

log = logging.getLogger(__name__)

Emit = Callable[[pb.Event], None]
_OUTPUT_EOF_WAIT = 1.0   # a user's background child may hold the pipes open


class WorkerRun:
    """One host's worker for one job."""

    def __init__(self, *, host: int, job_dir: str, env: Mapping[str, str], emit: Emit,
                 forward_output: bool, cancel_grace: float = 1.0) -> None:
        self.host = host
        self.job_dir = job_dir
        self._env = dict(env)
        self._emit = emit
        self._forward_output = forward_output
        self._cancel_grace = cancel_grace
        self._tail = Tail()
        self._lock = threading.Lock()
        self._cancelled = False
        self._outputs_closed: list[threading.Event] = []
        self._status_thread: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None
        self._control_w: int | None = None
        self.report = pb.HostReport(host=host, state=pb.HOST_STATE_PENDING)
        self.result_sha256 = b""          # process 0's result file, once written
        self.finished = threading.Event()   # set once the `exited` event is out

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        control_r, self._control_w = os.pipe()
        self._status_r, status_w = os.pipe()
        env = dict(self._env)
        env[_worker.ENV_CONTROL_FD] = str(control_r)
        env[_worker.ENV_STATUS_FD] = str(status_w)
        env[_worker.ENV_JOB_DIR] = self.job_dir
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "remote_tpu_agent._worker"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(control_r, status_w), start_new_session=True, env=env,
            )
        finally:
            os.close(control_r)
            os.close(status_w)
        self.report.state = pb.HOST_STATE_RUNNING
        self._emit(pb.Event(host=self.host, started=pb.Started(pid=self.proc.pid)))
        for stream, pipe in ((pb.OUTPUT_STREAM_STDOUT, self.proc.stdout),
                             (pb.OUTPUT_STREAM_STDERR, self.proc.stderr)):
            closed = threading.Event()
            self._outputs_closed.append(closed)
            threading.Thread(target=self._pump_output, args=(stream, pipe, closed),
                             daemon=True, name=f"worker{self.host}-out").start()
        self._status_thread = threading.Thread(target=self._read_status, daemon=True,
                                               name=f"worker{self.host}-status")
        self._status_thread.start()
        threading.Thread(target=self._wait_exit, daemon=True,
                         name=f"worker{self.host}-wait").start()

    def release(self) -> None:
        """Every host has finished: let the worker exit."""
        if self._control_w is None:
            return
        try:
            os.write(self._control_w, _worker.CONTROL_RELEASE)
        except OSError:
            pass

    def stacks(self, wait: float = 1.0) -> str:
        """Every thread's Python stack in the worker, as it is now."""
        if self.proc is None or self.proc.poll() is not None:
            return "(the worker is not running)"
        path = os.path.join(self.job_dir, _worker.STACKS_FILE)
        before = os.path.getsize(path) if os.path.exists(path) else 0
        try:
            os.kill(self.proc.pid, _worker.STACKS_SIGNAL)
        except ProcessLookupError:
            return "(the worker is not running)"
        deadline = time.monotonic() + wait
        size = before
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = os.path.getsize(path) if os.path.exists(path) else 0
            if now > before and now == size:
                break           # it grew, and stopped growing
            size = now
        with open(path, errors="replace") as f:
            f.seek(before)
            text = f.read()
        return text or "(no answer: the worker did not dump its stacks in time)"

    def cancel(self) -> None:
        """Stop the worker's whole process group (SIGTERM, then SIGKILL)."""
        with self._lock:
            self._cancelled = True
        if self.proc is not None:
            stop_group(self.proc, self._cancel_grace)

    def close(self) -> None:
        """Called when the job is over: nothing of it may survive."""
        if self.proc is not None and self.proc.poll() is None:
            self.cancel()
        if self._control_w is not None:
            try:
                os.close(self._control_w)
            except OSError:
                pass
            self._control_w = None

    # ------------------------------------------------------------ threads

    def _pump_output(self, stream: int, pipe, closed: threading.Event) -> None:
        noise = NoiseFilter()
        fd = pipe.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                self._tail.feed(data)
                shown = noise.feed(data)
                # Once we stop a host, what it prints while dying (JAX's
                # "SIGTERM caught", say) is our doing: kept in the tail only.
                if shown and self._forward_output and not self._cancelled:
                    self._emit(pb.Event(host=self.host,
                                        output=pb.Output(stream=stream, data=shown)))
            rest = noise.flush()
            if rest and self._forward_output and not self._cancelled:
                self._emit(pb.Event(host=self.host, output=pb.Output(stream=stream, data=rest)))
        finally:
            pipe.close()
            closed.set()

    def _wait_outputs(self) -> None:
        deadline = time.monotonic() + _OUTPUT_EOF_WAIT
        for closed in self._outputs_closed:
            closed.wait(max(0.0, deadline - time.monotonic()))

    def _read_status(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self._status_r, 1)
                except InterruptedError:
                    continue
                if not data:
                    return
                if data == _worker.STATUS_DONE:
                    self._wait_outputs()
                    self._on_done()
        finally:
            os.close(self._status_r)

    def _on_done(self) -> None:
        path = os.path.join(self.job_dir, _worker.OUTCOME_FILE)
        try:
            with open(path) as f:
                outcome = json.load(f)
        except (OSError, ValueError) as exc:
            outcome = {"state": "failed", "phase": "reporting",
                       "exception": {"type_name": "OSError", "message": str(exc),
                                     "traceback": "", "pickled": ""}}
        with self._lock:
            if outcome.get("state") == "succeeded":
                self.result_sha256 = bytes.fromhex(outcome.get("result_sha256", ""))
                self.report.state = pb.HOST_STATE_SUCCEEDED
                self.report.detail = "returned"
            else:
                exc = outcome.get("exception", {})
                self.report.state = pb.HOST_STATE_FAILED
                self.report.finished_at = float(outcome.get("failed_at", time.time()))
                self.report.detail = (f"raised {exc.get('type_name', '?')} while "
                                      f"{outcome.get('phase', 'running')}")
                self.report.exception.CopyFrom(pb.RemoteException(
                    type_name=exc.get("type_name", ""), message=exc.get("message", ""),
                    traceback=exc.get("traceback", ""),
                    pickled=bytes.fromhex(exc.get("pickled", "")),
                ))
            report = pb.HostReport()
            report.CopyFrom(self.report)
        self._emit(pb.Event(host=self.host, done=report))

    def _wait_exit(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        seen_at = time.time()
        # Whatever the worker left in its process group goes with it.
        stop_group(self.proc, grace=0)
        self._wait_outputs()
        if self._status_thread is not None:
            self._status_thread.join(timeout=2)
        with self._lock:
            r = self.report
            r.exited = True
            r.exit_code = code
            r.signal = signal_name(code)
            if r.state in (pb.HOST_STATE_PENDING, pb.HOST_STATE_RUNNING):
                if self._cancelled:
                    r.state = pb.HOST_STATE_CANCELLED
                    r.detail = "stopped by remote_tpu"
                else:
                    r.state = pb.HOST_STATE_DIED
                    r.finished_at = seen_at
                    r.detail = (f"killed by {r.signal}" if r.signal
                                else f"exited with code {code} before the function returned")
            if r.state != pb.HOST_STATE_SUCCEEDED:
                r.last_lines[:] = self._tail.lines()
            report = pb.HostReport()
            report.CopyFrom(r)
        self._emit(pb.Event(host=self.host, exited=report))
        self.finished.set()


# What of the agent's own environment a worker sees: what a Python program needs
# to run, and what configures the accelerator stack. Nothing else (the agent's
# token least of all) unless the agent is started with --pass-env NAME.
_PASSED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH",
})
_PASSED_PREFIXES = ("LC_", "TPU_", "JAX_", "XLA_", "LIBTPU_", "CLOUD_TPU_", "TF_CPP_",
                    "OPENBLAS_", "OMP_", "MKL_")


def passed_environment(base: Mapping[str, str], extra: frozenset[str] = frozenset()
                       ) -> dict[str, str]:
    return {k: v for k, v in base.items()
            if (k in _PASSED_NAMES or k.startswith(_PASSED_PREFIXES) or k in extra)
            and not k.startswith("REMOTE_TPU_")}


def processes_per_host(spec: pb.JobSpec) -> int:
    return max(1, spec.processes_per_host)


def num_processes(spec: pb.JobSpec) -> int:
    return spec.num_hosts * processes_per_host(spec)


# The chips of one TPU host as a 2D grid (4 chips: 2x2; 8 chips: 2x4).
_HOST_GRID = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}
TPU_PROCESS_BASE_PORT = 8476


def tpu_process_env(chips_per_host: int, n: int, k: int) -> dict[str, str]:
    """The variables JAX documents for running ``n`` processes on one TPU host
    (this is process ``k``): each sees its own chips and its siblings' ports."""
    gx, gy = _HOST_GRID.get(chips_per_host, (1, chips_per_host))
    per = chips_per_host // n
    cx = 1 if per < gx or per == 1 else gx
    cy = per // cx
    return {
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in range(k * per, (k + 1) * per)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": f"{cx},{cy},1",
        "TPU_PROCESS_BOUNDS": f"{gx // cx},{gy // cy},1",
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{TPU_PROCESS_BASE_PORT + j}"
                                          for j in range(n)),
        "TPU_PROCESS_PORT": str(TPU_PROCESS_BASE_PORT + k),
        "CLOUD_TPU_TASK_ID": str(k),
    }


def worker_env(base: Mapping[str, str], *, spec: pb.JobSpec, process_id: int,
               coordinator: str, simulate_devices: int) -> dict[str, str]:
    """The environment of one worker: the agent's (as passed_environment has
    filtered it), the user's ``env=``, and JAX's."""
    n = processes_per_host(spec)
    env = dict(base)
    env.update(spec.env)
    env.update({
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(num_processes(spec)),
        "JAX_PROCESS_ID": str(process_id),
        "REMOTE_TPU_JOB_ID": spec.job_id,
        "REMOTE_TPU_HOST_INDEX": str(process_id // n),
        "REMOTE_TPU_PROCESS_INDEX": str(process_id),
        "REMOTE_TPU_NUM_HOSTS": str(spec.num_hosts),
        "REMOTE_TPU_ACCELERATOR": spec.accelerator,
        "PYTHONUNBUFFERED": "1",     # prints reach the caller as they happen
        _worker.ENV_PAYLOAD_SHA256: spec.payload_sha256.hex(),
    })
    timeouts = spec.jax_timeouts
    if timeouts.initialization_seconds:
        env[_worker.ENV_INIT_TIMEOUT] = str(timeouts.initialization_seconds)
    if timeouts.heartbeat_seconds:
        env[_worker.ENV_HEARTBEAT_TIMEOUT] = str(timeouts.heartbeat_seconds)
    if timeouts.shutdown_seconds:
        env[_worker.ENV_SHUTDOWN_TIMEOUT] = str(timeouts.shutdown_seconds)
    if simulate_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env[_worker.ENV_SIMULATE_DEVICES] = str(max(1, simulate_devices // n))
    elif n > 1:
        from remote_tpu._topology import Topology
        chips = Topology.parse(spec.accelerator).chips_per_host
        env.update(tpu_process_env(chips, n, process_id % n))
    return env
