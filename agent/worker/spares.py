"""Spare workers: processes started before their job, so a cold call pays only
``jax.distributed``'s initialization and the call itself.

A spare is a worker (``worker.child``) whose Python is up and whose ``jax`` and
remote_tpu modules are imported, waiting for its first call; importing jax does
not take the TPU, so a spare never holds it. After a job with ``init_jax=False``
the next spare is a light one, without jax (a small part of the CPU and
memory of one with it): an agent whose jobs do not use JAX does not import
it for nothing after each (64 simulated hosts on one machine would spend a
minute of CPU on it); a JAX job given a light spare imports jax in its call.
``take`` hands one to a job's ``WorkerRun`` (which adopts its process and
pipes) when the job's environment agrees with the spare's on everything read
while importing (``fits``); a new spare is started a moment later, off the
job's critical start, ready for a next call that follows at once. With
``--light-spares`` (many simulated hosts sharing one machine's CPU) it is
started once that worker has exited (or 2 s after the take, for a job that runs
on) and the machine's CPUs are idle again: a real host replaces its spare on
its own CPU, while 64 simulated ones started as their workers exit took
seconds of the CPU that the call's last hosts still needed, and doubled its
time; while the CPUs stay busy, a cold call starts its own worker. A spare
that dies is replaced (with a growing pause if spares keep dying), and every
spare dies with its agent: it reads its control pipe, whose end closes when the
agent goes. Figures: benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.worker.processes import stop_group

log = logging.getLogger(__name__)

_REFILL_DELAY = 0.1        # after a take: the job's own workers start first
_REFILL_AFTER = 2.0        # light spares: this long after a take (then once idle)
_WATCH_INTERVAL = 0.5
_IDLE_SAMPLE = 0.2         # light spares: how long each look at the CPUs lasts,
_IDLE_SHARE = 0.5          # and the share of it they must have been idle
# Variables known to be read only once the job's call has come (by our worker,
# by jax.distributed.initialize, by libtpu when JAX first uses the TPU): a job
# may set them differently from the spare's start. Any other difference (a
# user's env=, which OpenBLAS, OpenMP, Python or an import may read as the
# process starts) needs a worker started with it.
_READ_LATER = frozenset({"JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES",
                         "CLOUD_TPU_TASK_ID", "ALLOW_MULTIPLE_LIBTPU_LOAD"})
_READ_LATER_PREFIXES = ("REMOTE_TPU_", "TPU_", "MEGASCALE_")


def fits(spare_env: Mapping[str, str], job_env: Mapping[str, str]) -> bool:
    """Whether a spare started with ``spare_env`` can run a job whose worker
    environment is ``job_env``."""
    if job_env.get(_worker.ENV_PYTHON, "") != spare_env.get(_worker.ENV_PYTHON, ""):
        return False                   # another interpreter (requirements=): a new process
    return all(spare_env.get(k) == job_env.get(k) for k in {*spare_env, *job_env}
               if k not in _READ_LATER and not k.startswith(_READ_LATER_PREFIXES))


@dataclasses.dataclass
class Spare:
    """A spare's process and the agent's ends of its pipes."""

    proc: subprocess.Popen
    env: dict[str, str]
    control_w: int
    status_r: int
    out_r: int
    err_r: int
    stacks_path: str

    def close(self) -> None:
        stop_group(self.proc, grace=0)
        for fd in (self.control_w, self.status_r, self.out_r, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass


def spawn(env: Mapping[str, str], stacks_dir: str, spare: bool = False
          ) -> tuple[subprocess.Popen, int, int, int, int]:
    """Start a worker process in its own process group: (process, control
    pipe's write end, status pipe's read end, stdout's and stderr's read ends)."""
    os.makedirs(stacks_dir, mode=0o700, exist_ok=True)     # a job's: made on first need
    control_r, control_w = os.pipe()
    status_r, status_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    for fd in (out_r, err_r):           # a print burst need not wait for the agent's read
        _grow_pipe(fd)
    full = dict(env)
    full[_worker.ENV_CONTROL_FD] = str(control_r)
    full[_worker.ENV_STATUS_FD] = str(status_w)
    full[_worker.ENV_JOB_DIR] = stacks_dir
    python = env.get(_worker.ENV_PYTHON) or sys.executable      # requirements=: its venv's
    argv = [python, "-m", "remote_tpu_agent.worker.child"] + (["--spare"] if spare else [])
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                                pass_fds=(control_r, status_w), start_new_session=True,
                                env=full)
    except BaseException:
        for fd in (control_w, status_r, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (control_r, status_w, out_w, err_w):
            os.close(fd)
    return proc, control_w, status_r, out_r, err_r


_PIPE_BYTES = 1 << 20


def _grow_pipe(fd: int) -> None:
    """Give a pipe 1 MiB of buffer (Linux; the default is 64 KiB); where that
    is refused or unknown, it keeps its own."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except OSError:
        pass


class Spares:
    """This agent's spare worker (``count`` of them: 0 or 1)."""

    def __init__(self, env: Mapping[str, str], state_dir: str, count: int = 1,
                 light: bool = False) -> None:
        self.env = dict(env)
        self.count = count
        self._always_light = light
        self._light = light          # the next spare without jax (the last job's kind)
        # Every worker's own files (its stacks), outside any job's directory: a
        # warm worker outlives the job it started with.
        self._dir = os.path.join(state_dir, "workers")
        shutil.rmtree(self._dir, ignore_errors=True)     # an earlier agent's
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._spares: list[Spare] = []
        self._stopped = threading.Event()
        self._deaths: list[float] = []       # when spares died untaken, recently
        self._timer: threading.Timer | None = None    # the next refill, after a take
        self._idle_wait = False      # light spares: a thread waits for idle CPUs to refill
        if count:
            self._refill()
            threading.Thread(target=self._watch, daemon=True, name="spares").start()

    def take(self, job_env: Mapping[str, str]) -> Spare | None:
        """A spare for a job with this worker environment, or None."""
        if not fits(self.env, job_env):
            return None
        self._light = self._always_light or job_env.get(_worker.ENV_INIT_JAX) == "0"
        with self._lock:
            spare = next((s for s in self._spares if s.proc.poll() is None), None)
            if spare is not None:
                self._spares.remove(spare)
        if spare is not None:
            timer = (threading.Timer(_REFILL_AFTER, self._refill_once_idle)
                     if self._always_light else threading.Timer(_REFILL_DELAY, self._refill))
            timer.daemon = True
            with self._lock:
                if self._timer is not None:
                    self._timer.cancel()     # an earlier take's: never during a later job
                self._timer = timer
            timer.start()
        return spare

    def replace(self) -> None:
        """A spare taken has done its job (its worker exited): with light
        spares, the next one starts once the CPUs are idle."""
        if self._always_light:
            self._refill_once_idle()

    def worker_dir(self) -> str:
        """A new directory for one worker's own files (removed when it ends)."""
        path = os.path.join(self._dir, f"worker-{next(self._numbers)}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            spare.close()

    def _refill(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._stopped.is_set() or len(self._spares) >= self.count:
                return
            stacks = self.worker_dir()
            env = {**self.env, _worker.ENV_INIT_JAX: "0"} if self._light else self.env
            try:
                proc, control_w, status_r, out_r, err_r = spawn(env, stacks, spare=True)
            except OSError as exc:
                log.warning("cannot start a spare worker: %s", exc)
                return
            self._spares.append(Spare(proc, env, control_w, status_r, out_r, err_r,
                                      os.path.join(stacks, _worker.STACKS_FILE)))

    def _refill_once_idle(self) -> None:
        """Light spares: refill once this machine's CPUs were at least half idle
        over a look, so not while a call's simulated hosts still run, however
        long that takes (a deadline would start 64 spares at once in the middle
        of a later call); at once where the CPUs cannot be read. One thread
        waits, whatever the number of takes meanwhile."""
        with self._lock:
            if self._idle_wait:
                return
            self._idle_wait = True
        threading.Thread(target=self._wait_idle_then_refill, daemon=True,
                         name="spare-refill").start()

    def _wait_idle_then_refill(self) -> None:
        try:
            before = _cpu_ticks()
            while before is not None:
                if self._stopped.wait(_IDLE_SAMPLE):
                    return
                after = _cpu_ticks()
                if after is None:
                    break
                idle, total = after[0] - before[0], after[1] - before[1]
                if total > 0 and idle >= _IDLE_SHARE * total:
                    break
                before = after
        finally:
            with self._lock:
                self._idle_wait = False
        self._refill()

    def _watch(self) -> None:
        """Replace spares that died before any job took them."""
        while not self._stopped.wait(_WATCH_INTERVAL):
            with self._lock:
                dead = [s for s in self._spares if s.proc.poll() is not None]
                for spare in dead:
                    self._spares.remove(spare)
            for spare in dead:
                log.warning("spare worker %d died (exit %s); starting another",
                            spare.proc.pid, spare.proc.returncode)
                spare.close()
                self._deaths = [t for t in self._deaths if t > time.monotonic() - 60]
                self._deaths.append(time.monotonic())
            if dead:
                # Spares that keep dying (a broken install) are retried less often.
                if self._stopped.wait(min(30.0, 0.5 * 2 ** (len(self._deaths) - 1))):
                    return
                self._refill()


def _cpu_ticks() -> tuple[int, int] | None:
    """(idle, all) clock ticks of this machine's CPUs so far (Linux's
    /proc/stat), or None where they cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            ticks = [int(t) for t in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (ticks[3] + ticks[4], sum(ticks)) if len(ticks) == 8 else None
