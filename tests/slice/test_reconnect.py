"""An agent that restarts is reached by the very next call: neither the
gateway (to its peer) nor the client (to its gateway) keeps a channel that
found no agent, so nothing waits out a reconnect backoff."""

from __future__ import annotations

import signal

import pytest

import remote_tpu
from conftest import Agents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def pair(slice_factory):
    """Agents of the test's own: it restarts them."""
    return slice_factory(2)


def _restart(agents: Agents, i: int) -> None:
    agents.procs[i].send_signal(signal.SIGTERM)
    agents.restart(i)


def test_a_peer_that_restarted_takes_the_next_job(pair):
    @remote_tpu.run(accelerator="tpu-v4-16", hosts=pair.addresses[0], token=pair.token,
                    stream="none")
    def seven():
        return 7

    assert seven() == 7
    pair.procs[1].send_signal(signal.SIGTERM)
    pair.procs[1].wait(10)
    with pytest.raises(remote_tpu.JobFailedError, match=pair.addresses[1]):
        seven()
    pair.restart(1)
    assert seven() == 7                          # at once, not after a backoff


def test_a_gateway_that_restarted_answers_the_next_listing(pair):
    listing = dict(hosts=pair.addresses[0], token=pair.token)
    assert remote_tpu.jobs(**listing) == []
    pair.procs[0].send_signal(signal.SIGTERM)
    pair.procs[0].wait(10)
    with pytest.raises(remote_tpu.AgentUnavailableError):
        remote_tpu.jobs(**listing)
    pair.restart(0)
    assert remote_tpu.jobs(**listing) == []
