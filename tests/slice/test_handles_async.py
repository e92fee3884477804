"""Handles in Python's async world: a JobHandle answering as a Future
(concurrent.futures.wait, callbacks), ``await handle`` and ``await fn.aio()``
without blocking the event loop, a cancelled task cancelling its job, and a
call's job id reachable after it raised. Real agents on loopback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import traceback

import pytest

import remote_tpu
from conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _step(pair):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts=pair.addresses[0], token=pair.token,
                    init_jax=False)
    def step(x, seconds=0.0):
        import os
        import time
        host = int(os.environ["REMOTE_TPU_HOST_INDEX"])
        print(f"step {x} on host {host}", flush=True)
        time.sleep(seconds)
        if x == "boom" and host == 0:
            raise ValueError(f"boom on host {host}")
        if x == "die" and host == 1:
            os._exit(3)
        return x
    return step


async def _ticking(make, ticks: list[float]):
    """``make()``'s value, awaited, a ticker running beside it: the loop is
    free if it ticks."""
    async def tick():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)
    ticker = asyncio.ensure_future(tick())
    try:
        return await make()
    finally:
        ticker.cancel()


def test_two_aio_calls_gathered_on_one_slice_the_second_queued(pair, capfd):
    step = _step(pair)
    ticks: list[float] = []
    started = time.monotonic()
    values = asyncio.run(_ticking(lambda: asyncio.gather(step.aio(1, 1.0),
                                                          step.aio(2, 1.0)), ticks))
    took = time.monotonic() - started
    assert values == [1, 2]
    out, err = capfd.readouterr()
    assert "step 1 on host 0" in out and "step 2 on host 0" in out, out   # shown live
    assert "is queued behind job step-" in err, err          # one slice: one after the other
    assert len(ticks) >= 10, f"the loop ticked {len(ticks)} times in {took:.1f} s"


def test_a_remote_exception_through_await_carries_its_job_id(pair):
    step = _step(pair)
    assert step.last_job is None

    async def main():
        with pytest.raises(ValueError, match="boom on host 0") as raised:
            await step.aio("boom")
        return raised.value
    exc = asyncio.run(main())
    assert exc.job_id == step.last_job.id and exc.job_id.startswith("step-")
    assert step.last_job.status().state == "FAILED"
    assert step.last_job.exception() is not None


def test_an_awaited_remote_error_shows_one_frame_of_the_sdk(pair):
    step = _step(pair)

    async def main():
        raised = []
        for awaitable in (lambda: step.aio("boom"), lambda: step.submit("boom")):
            with pytest.raises(ValueError) as exc:
                await awaitable()
            raised.append(exc.value)
        return raised
    for exc, entry in zip(asyncio.run(main()), ("aio", "awaited")):
        sdk = [line for line in traceback.format_exception(exc)
               if line.lstrip().startswith('File "') and "/remote_tpu/" in line]
        assert len(sdk) == 1 and f"in {entry}" in sdk[0], "".join(traceback.format_exception(exc))


def test_a_blocking_call_that_raised_leaves_its_job_reachable(pair):
    step = _step(pair)
    with pytest.raises(ValueError) as raised:
        step("boom")
    failed = step.last_job
    assert raised.value.job_id == failed.id
    assert failed.status().state == "FAILED" and failed.logs() == "step boom on host 0\n"
    assert isinstance(failed.exception(), ValueError)

    with pytest.raises(remote_tpu.JobFailedError) as died:          # no exception to raise
        step("die")
    assert died.value.job_id == step.last_job.id != failed.id
    assert step(3) == 3 and step.last_job.status().state == "SUCCEEDED"
    handle = step.submit(4)                       # a submitted one too
    assert step.last_job is handle and handle.result(timeout=60) == 4


def test_a_user_exceptions_own_job_id_stays(pair):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts=pair.addresses[0], token=pair.token,
                    init_jax=False)
    def fails():
        class Refused(Exception):
            job_id = "the user's own"
        raise Refused("no")

    with pytest.raises(Exception, match="no") as raised:
        fails()
    assert raised.value.job_id == "the user's own"
    assert any(fails.last_job.id in note for note in raised.value.__notes__)


def test_await_a_submitted_handle_and_its_callbacks(pair, caplog):
    step = _step(pair)
    good, bad = step.submit(7, 0.5), step.submit("boom")
    seen: list[tuple[str, str, bool]] = []
    called = threading.Event()

    def note(handle):
        seen.append((handle.id, threading.current_thread().name, handle.done()))
        called.set()
    good.add_done_callback(note)
    bad.add_done_callback(note)
    bad.add_done_callback(lambda handle: 1 / 0)       # logged, not raised

    async def main():
        value = await good
        with pytest.raises(ValueError, match="boom"):
            await bad
        return value
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        assert asyncio.run(main()) == 7
        assert wait_until(lambda: len(seen) == 2, 10), seen
    assert {job for job, _, _ in seen} == {good.id, bad.id}
    assert all(done and thread != "MainThread" for _, thread, done in seen), seen
    assert "ZeroDivisionError" in caplog.text
    called.clear()
    good.add_done_callback(note)           # done already: called at once, here
    assert called.is_set() and seen[-1] == (good.id, "MainThread", True)


def test_handles_wait_together_as_real_futures(pair):
    step = _step(pair)
    slow = step.submit("slow", 60)
    assert wait_until(slow.running, 60)
    assert not slow.done() and not slow.cancelled()
    with pytest.raises(TimeoutError):
        slow.result(timeout=0.2)
    with pytest.raises(TimeoutError):
        slow.exception(timeout=0.2)
    assert slow.cancel().state == "CANCELLED"
    assert slow.done() and slow.cancelled() and not slow.running()
    assert isinstance(slow.exception(), remote_tpu.JobFailedError)

    handles = {step.submit(n).future(): n for n in (1, 2, 3)}
    handles[step.submit("boom").future()] = "boom"
    done, pending = concurrent.futures.wait(handles, timeout=120)
    assert not pending
    assert [f.result() for f in handles if f.exception() is None] == [1, 2, 3]
    completed = list(concurrent.futures.as_completed(handles, timeout=10))
    assert set(completed) == set(handles)
    assert isinstance(list(handles)[-1].exception(), ValueError)


def test_cancelling_the_awaiting_task_cancels_the_job(pair):
    step = _step(pair)

    async def main():
        task = asyncio.ensure_future(step.aio("long", 120))
        while step.last_job is None or step.last_job.status().state != "RUNNING":
            await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        called = step.last_job
        assert called.status().state == "CANCELLED"

        handle = step.submit("long", 120)               # a handle awaited past a deadline
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(handle, 1.0)
        return called, handle
    started = time.monotonic()
    called, handle = asyncio.run(main())
    assert time.monotonic() - started < 60
    assert handle.status().state == "CANCELLED" and handle.cancelled()
    assert called.cancelled()


def test_await_in_a_notebook_cell(pair):
    jupyter_client = pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    from test_notebook import _run_cell

    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        reply, out = _run_cell(kc, f"""
import asyncio, remote_tpu
@remote_tpu.run(accelerator="tpu-v4-16", hosts={pair.addresses[0]!r},
                token={pair.token!r}, init_jax=False)
def step(x):
    print("step", x, flush=True)
    return x * 2
values = await asyncio.gather(step.aio(1), step.aio(2))
print("values", values, await step.submit(5))
""")
        assert reply["status"] == "ok", out
        assert "values [2, 4] 10" in out and "step 1" in out, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_gateway_out_of_reach_for_a_moment_does_not_end_the_future(pair, monkeypatch):
    """The thread behind ``future()``, ``await`` and callbacks asks again when
    the gateway cannot be reached for a moment (here: once), rather than
    ending with that error for good and calling back while the job runs."""
    from remote_tpu._core.exceptions import AgentUnavailableError
    from remote_tpu._jobs import JobHandle
    handle = _step(pair).submit(42, 1.0)
    real, failures = JobHandle._result, []

    def blip(self, timeout):
        if not failures:
            failures.append(1)
            raise AgentUnavailableError("the gateway did not answer (a blip)")
        return real(self, timeout)
    monkeypatch.setattr(JobHandle, "_result", blip)
    called: list[bool] = []
    handle.add_done_callback(lambda h: called.append(h.done()))
    assert handle.future().result(timeout=60) == 42 and failures == [1]
    assert asyncio.run(_awaited(handle)) == 42
    assert wait_until(lambda: called, 10) and called == [True]     # at its end only


async def _awaited(handle):
    return await handle
