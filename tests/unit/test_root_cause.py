"""Which host the gateway names as a failed job's root cause: ``root_cause`` over
every host's final report, a pure function. Fast, no agents, no JAX."""

from __future__ import annotations

import pytest

from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.gateway.root_cause import root_cause

pytestmark = pytest.mark.timeout(60)


def ok(host: int, at: float = 0.0) -> pb.HostReport:
    return pb.HostReport(host=host, state=pb.HOST_STATE_SUCCEEDED, finished_at=at)


def failed(host: int, at: float = 0.0, message: str = "boom",
           type_name: str = "builtins.ValueError") -> pb.HostReport:
    return pb.HostReport(host=host, state=pb.HOST_STATE_FAILED, finished_at=at,
                         exception=pb.RemoteException(type_name=type_name, message=message))


def died(host: int, at: float = 0.0, signal: str = "SIGKILL") -> pb.HostReport:
    return pb.HostReport(host=host, state=pb.HOST_STATE_DIED, finished_at=at, signal=signal)


def lost(host: int, at: float = 0.0) -> pb.HostReport:
    return pb.HostReport(host=host, state=pb.HOST_STATE_LOST, finished_at=at,
                         detail="agent at 10.0.0.3:50051 stopped answering")


# ---------------------------------------------------------------- no failure

def test_no_hosts_means_no_root_cause():
    assert root_cause([]) == -1


def test_every_host_succeeded_means_no_root_cause():
    assert root_cause([ok(0, 5.0), ok(1, 6.0), ok(2, 7.0)]) == -1


def test_pending_running_and_cancelled_hosts_are_not_failures():
    reports = [pb.HostReport(host=0, state=pb.HOST_STATE_PENDING),
               pb.HostReport(host=1, state=pb.HOST_STATE_RUNNING),
               pb.HostReport(host=2, state=pb.HOST_STATE_CANCELLED, finished_at=1.0)]
    assert root_cause(reports) == -1


# ---------------------------------------------------------------- first to fail

def test_the_only_failed_host_is_the_root_cause():
    assert root_cause([ok(0, 1.0), failed(1, 9.0), ok(2, 2.0)]) == 1


def test_the_first_host_to_fail_by_finished_at_is_the_root_cause():
    assert root_cause([failed(0, 30.0), failed(1, 10.0), failed(2, 20.0)]) == 1


def test_order_in_the_list_does_not_matter_only_finished_at():
    reports = [failed(2, 20.0), failed(0, 30.0), failed(1, 10.0)]
    assert root_cause(reports) == 1
    assert root_cause(list(reversed(reports))) == 1


def test_a_succeeded_host_that_finished_earlier_is_never_the_root_cause():
    assert root_cause([ok(0, 1.0), failed(1, 50.0)]) == 1


def test_a_sigkill_death_is_a_root_cause_of_its_own():
    assert root_cause([failed(0, 20.0), died(1, 10.0, "SIGKILL")]) == 1


def test_a_sigsegv_death_is_a_root_cause_of_its_own():
    assert root_cause([failed(0, 20.0), died(1, 10.0, "SIGSEGV")]) == 1


def test_a_lost_host_counts_as_a_failure():
    assert root_cause([ok(0, 1.0), lost(1, 5.0)]) == 1


def test_a_lost_host_that_was_lost_first_is_the_root_cause():
    assert root_cause([failed(0, 20.0), lost(1, 10.0)]) == 1


# ---------------------------------------------------------------- secondary failures

@pytest.mark.parametrize("type_name, message", [
    ("jaxlib.xla_extension.XlaRuntimeError",
     "INTERNAL: Connection closed by peer [10.0.0.2]:8476"),
    ("jax.errors.JaxRuntimeError", "Connection closed by peer"),
    ("jax.errors.JaxRuntimeError", "connection reset by peer"),
    ("jax.errors.JaxRuntimeError", "Gloo context initialization failed"),
    ("jax.errors.JaxRuntimeError", "UNAVAILABLE: failed to connect to all addresses"),
    ("jax.errors.JaxRuntimeError", "DEADLINE_EXCEEDED: barrier timed out"),
    ("jax.errors.JaxRuntimeError", "Deadline Exceeded"),
    ("jax.errors.JaxRuntimeError", "task /job:jax_worker/task:1 heartbeat timeout"),
    ("jax.errors.JaxRuntimeError", "Barrier failed: wait_at_barrier"),
    ("jax.errors.JaxRuntimeError", "coordination service has stopped"),
    ("builtins.OSError", "Socket closed"),
    ("builtins.BrokenPipeError", "[Errno 32] Broken pipe"),
    ("gloo.EnforceNotMet", "something"),        # the type's name alone says so
])
def test_a_secondary_failure_loses_to_a_host_that_failed_on_its_own(type_name, message):
    secondary = failed(0, 10.0, message, type_name)        # finished first
    primary = failed(1, 20.0, "shape mismatch (3,) vs (4,)")
    assert root_cause([secondary, primary]) == 1
    assert root_cause([primary, secondary]) == 1


def test_a_sigabrt_death_is_secondary_and_loses_to_a_real_failure():
    assert root_cause([died(0, 10.0, "SIGABRT"), failed(1, 20.0)]) == 1


def test_a_sigabrt_death_loses_to_a_sigkill_death():
    assert root_cause([died(0, 10.0, "SIGABRT"), died(1, 20.0, "SIGKILL")]) == 1


def test_a_secondary_failure_loses_to_a_lost_host():
    assert root_cause([failed(0, 10.0, "Connection closed by peer"), lost(1, 20.0)]) == 1


def test_when_every_failure_is_secondary_the_first_of_them_is_the_root_cause():
    reports = [failed(0, 30.0, "Connection closed by peer"),
               died(1, 20.0, "SIGABRT"),
               failed(2, 25.0, "DEADLINE_EXCEEDED")]
    assert root_cause(reports) == 1


def test_an_ordinary_exception_is_not_mistaken_for_a_secondary_one():
    reports = [failed(0, 20.0, "division by zero", "builtins.ZeroDivisionError"),
               failed(1, 10.0, "list index out of range", "builtins.IndexError")]
    assert root_cause(reports) == 1


# ---------------------------------------------------------------- ties and missing times

def test_a_tie_in_finished_at_goes_to_the_lower_host_index():
    assert root_cause([failed(2, 10.0), failed(1, 10.0), failed(3, 10.0)]) == 1


def test_a_tie_among_hosts_without_finished_at_goes_to_the_lower_host_index():
    assert root_cause([failed(3), lost(2), died(5)]) == 2


def test_a_report_without_finished_at_sorts_after_every_timed_one():
    assert root_cause([failed(0), failed(1, 1e12)]) == 1


def test_a_primary_failure_without_finished_at_still_beats_a_timed_secondary_one():
    assert root_cause([failed(0, 1.0, "Connection closed by peer"), failed(1)]) == 1
