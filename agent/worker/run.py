"""Runs one worker subprocess on this host and reports on it.

A :class:`WorkerRun` spawns the worker in its own process group, hands it its
call (``worker.call``: over the control pipe), forwards its stdout/stderr
(``worker.run_output``: read at the file-descriptor level, so output from C and
XLA is caught too), reads its
outcome (from the status pipe), and emits ``Event`` messages: ``started``,
``output``, ``done`` (the function finished) and finally ``exited`` (the process
is gone), whose report is the host's final state.

A warm run (``keep_warm``) outlives its call: once its function has returned it
parks (its ``exited`` event says ``warm``), and ``next_call`` hands the same
process the next call, with that call's events.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.worker import child as _worker
from remote_tpu_agent.worker import frames as wire
from remote_tpu_agent.worker.call import Call, apply_outcome, unreadable
from remote_tpu_agent.worker.processes import signal_name, stop_group
from remote_tpu_agent.worker.progress import CPU, LOOK_SECONDS
from remote_tpu_agent.worker.run_output import HeldOutput, WorkerOutput
from remote_tpu_agent.worker.spares import Spares, spawn
from remote_tpu_agent.worker.stacks import dump_stacks

log = logging.getLogger(__name__)

Emit = Callable[[pb.Event], None]
# Once the worker's process group is gone its pipes end at once, unless a
# process that left the group (setsid) holds them.
_ESCAPED_HOLDER_WAIT = 2.0      # below the gateway's SETTLE_SECONDS (gateway.ending)
# What a parked warm worker prints between calls (a thread of the user's) is
# kept for the next call, up to this much; beyond it is counted and said.
_PARKED_OUTPUT_BYTES = 1 << 20
# A worker that failed here is not whole: it does not park (``_may_park``).
UNPARKABLE_PHASES = ("initializing jax.distributed", "reporting")


def _may_park(report: pb.HostReport, outcome: dict) -> bool:
    """Whether a warm worker may wait for the session's next call after this
    outcome: after its function returned or raised, not when its call could
    not start (``jax.distributed`` down: every later call would fail alike)
    or its outcome could not be read."""
    if report.state == pb.HOST_STATE_SUCCEEDED:
        return True
    return report.state == pb.HOST_STATE_FAILED and \
        outcome.get("phase") not in UNPARKABLE_PHASES


def value_events(host: int, value: bytes | str | None):
    """A pickled value as result events: its size, then its chunks (read from
    its file when it is in one)."""
    if value is None:
        return
    if isinstance(value, bytes):
        yield pb.Event(host=host, result_size=len(value))
        for start in range(0, len(value), CHUNK_SIZE):
            yield pb.Event(host=host, result_chunk=value[start:start + CHUNK_SIZE])
        return
    with open(value, "rb") as f:
        yield pb.Event(host=host, result_size=os.fstat(f.fileno()).st_size)
        while chunk := f.read(CHUNK_SIZE):
            yield pb.Event(host=host, result_chunk=chunk)


def _ignore(event: pb.Event) -> None:
    """Where a parked warm worker's events go: its call is over."""


class WorkerRun:
    """One host's worker for one job (or, warm, for a session's calls): a
    ``worker.handle.ProcessHandle``.

    Why over 200 lines: the process's start (or a spare adopted), its call
    and a warm session's next ones, its outcome and its exit change one
    report under one lock, from four threads; its output pipes are apart
    (``worker.run_output``)."""

    def __init__(self, *, host: int, call: Call, emit: Emit, forward_output: bool,
                 cancel_grace: float = 1.0, warm: bool = False,
                 spares: Spares | None = None, emit_value: bool = False) -> None:
        self.host = host
        # A peer's: its value, where its call asks for every process's
        # (all_results=), goes out as result events just before its `done`.
        self._emit_value = emit_value
        self._spares = spares
        self._adopted = False             # its process was a spare (``worker.spares``)
        self.call = call
        self.warm = warm
        self.calls = 1                    # calls this process has been given
        self.parked = False               # warm, between calls
        self._held = HeldOutput(_PARKED_OUTPUT_BYTES)   # printed while parked
        self._stacks_path = os.path.join(call.job_dir, _worker.STACKS_FILE)
        self._env = dict(call.env)
        self._emit = emit
        self._forward_output = forward_output
        self._cancel_grace = cancel_grace
        self._lock = threading.Lock()
        self._cancelled = False
        self._output = WorkerOutput(host, self._emit_output)
        self._stacks_ready = threading.Event()   # the worker can dump its stacks
        self._status_thread: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None
        self._control_w: int | None = None
        # Writing to the control pipe and closing it exclude each other: a
        # close racing a write (or a second close) would hit whatever pipe
        # took the descriptor's number next, another worker's.
        self._control_lock = threading.Lock()
        self.report = pb.HostReport(host=host, state=pb.HOST_STATE_PENDING)
        self.result_digest = b""          # process 0's value (all_results=: any's), pickled
        self.result: bytes | None = None  # ... inline
        self.result_file = ""             # ... or in this file
        self.finished = threading.Event()   # set once the `exited` event is out
        # Called when a parked (warm) worker's process ends between calls.
        self.on_parked_exit: Callable[[], None] | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker (or adopt this agent's spare) and hand it its call."""
        spare = self._spares.take(self._env) if self._spares is not None else None
        self._adopted = spare is not None
        if spare is not None:        # already up, jax imported: the call only adds
            self.proc, self._control_w = spare.proc, spare.control_w
            self._status_r, out_r, err_r = spare.status_r, spare.out_r, spare.err_r
            self._stacks_path = spare.stacks_path
            env_changes = {k: v for k, v in self._env.items() if spare.env.get(k) != v}
        else:
            own = self._spares.worker_dir() if self._spares is not None else self.call.job_dir
            self._stacks_path = os.path.join(own, _worker.STACKS_FILE)
            self.proc, self._control_w, self._status_r, out_r, err_r = spawn(self._env, own)
            env_changes = {}
        self.report.state = pb.HOST_STATE_RUNNING
        self._emit(pb.Event(host=self.host, started=pb.Started(pid=self.proc.pid)))
        self._output.start(out_r, err_r)
        self._status_thread = threading.Thread(target=self._read_status, daemon=True,
                                               name=f"worker{self.host}-status")
        self._status_thread.start()
        threading.Thread(target=self._wait_exit, daemon=True,
                         name=f"worker{self.host}-wait").start()
        self._watch_cpu()
        # A payload of up to INLINE_BYTES fills the pipe until the worker is up
        # to read it: the caller does not wait for that.
        threading.Thread(target=self._send, args=(self.call, env_changes), daemon=True,
                         name=f"worker{self.host}-call").start()

    def release(self) -> None:
        """Every host has finished: let the worker exit. (A warm worker parked
        itself as soon as its function returned: no process exits, so none
        can leave a peer in a collective.)"""
        if self.parked:
            return
        self._write_control(lambda fd: wire.write_frame(fd, wire.RELEASE))

    def _send(self, call: Call, env_changes: dict[str, str]) -> bool:
        return self._write_control(lambda fd: call.send(fd, env_changes, self.warm))

    def _write_control(self, write: Callable[[int], None]) -> bool:
        """Write to the worker's control pipe, unless it is closed. (A write
        blocked on a full pipe ends once ``stop`` has killed the reader.)"""
        with self._control_lock:
            if self._control_w is None:
                return False
            try:
                write(self._control_w)
                return True
            except OSError:
                return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self._cancelled

    def pickled_value(self) -> bytes | str | None:
        """Its function's pickled value: inline, or the path of its file; None
        when it has none (it failed, or it was not pickled)."""
        with self._lock:
            if self.report.state != pb.HOST_STATE_SUCCEEDED or not self.result_digest:
                return None
            return self.result if self.result is not None else self.result_file

    def parked_output(self) -> list[tuple[int, bytes]]:
        """What a parked worker printed since its last call, taken: for a
        session that ends."""
        self._output.flush()
        with self._lock:
            return self._held.take()

    def next_call(self, call: Call, emit: Emit) -> bool:
        """Hand a parked warm worker its next call; False if it is gone."""
        changed = {k: v for k, v in call.env.items() if self._env.get(k) != v}
        with self._lock:
            if not (self.parked and self.alive):
                return False
            self.parked = False
            self.calls += 1
            self.call = call
            self._emit = emit
            self._output.new_call()
            self.report = pb.HostReport(host=self.host, state=pb.HOST_STATE_RUNNING)
            self.result_digest, self.result = b"", None
            self.finished.clear()
            held = self._held.take()
        self._env.update(changed)
        # (No ``started`` event: the session's first call said it, same pid.)
        for stream, data in held:
            self._emit_output(stream, data)
        self._watch_cpu()
        return self._send(call, changed)

    def stacks(self, wait: float = 1.0) -> str:
        """Every thread's Python stack in the worker, as it is now."""
        if self.proc is None or self.proc.poll() is not None:
            return "(the worker is not running)"
        if not self._stacks_ready.is_set():
            # Before the worker has set up its handler, the signal would kill it.
            return ("(the worker is still starting: it can report its stacks once Python "
                    "is up, in a moment)")
        return dump_stacks(self.proc.pid, self._stacks_path, wait)

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the function the worker runs (SIGINT to
        the worker alone: ``worker.child`` takes it only in the user's code)."""
        with self._lock:
            proc = None if self.parked or self._cancelled else self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def cancel(self) -> None:
        """Stop the worker's whole process group (SIGTERM, then SIGKILL)."""
        with self._lock:
            self._cancelled = True
        if self.proc is not None:
            stop_group(self.proc, self._cancel_grace)

    def close(self) -> None:
        """Called when the call is over: nothing of it may survive, but a
        parked warm worker (see ``stop``)."""
        if self.parked and self.alive:
            return
        self.stop()

    def stop(self) -> None:
        """End the worker, warm or not."""
        with self._lock:
            self.parked = False
        if self.proc is not None and self.proc.poll() is None:
            self.cancel()
        with self._control_lock:        # closed once, by one caller (see __init__)
            fd, self._control_w = self._control_w, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------ threads

    def _emit_output(self, stream: int, shown: bytes) -> None:
        # Once we stop a host, what it prints while dying (JAX's "SIGTERM
        # caught", say) is our doing: kept in the tail only.
        if not shown or not self._forward_output or self._cancelled:
            return
        with self._lock:
            if self.parked:
                self._held.add(stream, shown)
                return
        for start in range(0, len(shown), CHUNK_SIZE):
            self._emit(pb.Event(host=self.host, output=pb.Output(
                stream=stream, data=shown[start:start + CHUNK_SIZE])))

    def _await_eof(self) -> None:
        """The process group is gone: its pipes end, unless a process that
        left it holds them (read no longer after a while, less than the
        gateway's settle time, and said)."""
        if self._output.await_eof(_ESCAPED_HOLDER_WAIT):
            self._emit(pb.Event(host=self.host, output=pb.Output(
                stream=pb.OUTPUT_STREAM_STDERR,
                data=b"\n[remote_tpu: a process that left the worker's process group "
                     b"still holds its output open; nothing it writes from here on is "
                     b"collected]\n")))

    def _read_status(self) -> None:
        try:
            while (frame := wire.read_frame(self._status_r)) is not None:
                kind, header, blob = frame
                if kind == wire.READY:
                    self._stacks_ready.set()
                elif kind == wire.JAX_READY:
                    self._progress(pb.Progress(jax_ready=True))
                elif kind == wire.PROGRESS:
                    try:
                        progress = pb.Progress(has_step="step" in header,
                                               step=int(header.get("step", 0)))
                    except (TypeError, ValueError):          # (checked in the worker)
                        continue
                    self._progress(progress)
                elif kind == wire.DONE:
                    self._output.flush()
                    self._on_done(header, blob)
        finally:
            os.close(self._status_r)

    def _watch_cpu(self) -> None:
        """The worker looked at until the call is done (``worker.progress``:
        its CPU, progress for stall_after=; its memory, for remote-tpu top)."""
        if self.proc is not None:
            CPU.watch(self, self.proc.pid, self.call.stall_after or LOOK_SECONDS * 4,
                      self._progress)

    def _progress(self, progress: pb.Progress) -> None:
        """A progress event for the gateway's stall watch (not while parked:
        no call is running)."""
        with self._lock:
            emit = None if self.parked or self._cancelled else self._emit
        if emit is not None:
            emit(pb.Event(host=self.host, progress=progress))

    def _on_done(self, outcome: dict, result: bytes) -> None:
        CPU.forget(self)                      # the function is over
        with self._lock:
            try:
                apply_outcome(self.report, outcome)
            except Exception as exc:  # noqa: BLE001 - a host that finished must say so
                log.exception("host %d: unreadable outcome", self.host)
                outcome = unreadable(exc)
                apply_outcome(self.report, outcome)
            if self.report.state == pb.HOST_STATE_SUCCEEDED:
                self.result_digest = bytes.fromhex(outcome.get("result_digest", ""))
                self.result = result if not outcome.get("result_file") else None
                self.result_file = outcome.get("result_file", "")
            # A warm worker whose function returned (or raised: the worker is
            # whole) stays, for the next call: parked before anyone hears it is
            # done (so no release reaches it). Whether the session goes on is
            # the gateway's to say (``gateway.ending``).
            park = self.warm and self.alive and _may_park(self.report, outcome)
            report = pb.HostReport()
            report.CopyFrom(self.report)
            report.warm = park          # its `exited` (warm) follows at once: see peer.call
            self.parked = self.parked or park
            emit = self._emit
            if park:
                self._emit = _ignore          # this call's events end with its exit
            value = self._value_to_send()
        for event in value_events(self.host, value):
            emit(event)
        emit(pb.Event(host=self.host, done=report))
        if park:
            exited = pb.HostReport()
            exited.CopyFrom(report)
            exited.warm = True
            emit(pb.Event(host=self.host, exited=exited))
            self.finished.set()

    def _value_to_send(self) -> bytes | str | None:
        """(Under the lock.) The value a peer sends its gateway, if any."""
        if not (self._emit_value and self.result_digest and
                self.call.env.get(_worker.ENV_ALL_RESULTS) == "1" and
                self.report.state == pb.HOST_STATE_SUCCEEDED):
            return None
        return self.result if self.result is not None else self.result_file

    def _wait_exit(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        seen_at = time.time()
        # Whatever the worker left in its process group goes with it.
        stop_group(self.proc, grace=0)
        self._await_eof()
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
                r.last_lines[:] = self._output.last_lines()
            report = pb.HostReport()
            report.CopyFrom(r)
            was_parked, self.parked = self.parked, False
        self._emit(pb.Event(host=self.host, exited=report))
        CPU.forget(self)
        self.finished.set()
        own = os.path.dirname(self._stacks_path)
        if own != self.call.job_dir:            # the worker's own files go with it
            shutil.rmtree(own, ignore_errors=True)
        if self._adopted and self._spares is not None:
            self._spares.replace()              # the next job's spare, from now
        if was_parked and self.on_parked_exit is not None:
            self.on_parked_exit()
