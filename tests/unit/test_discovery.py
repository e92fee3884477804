"""How an agent finds its place in its slice without being told: a real HTTP
server stands in for each VM's metadata server (as GCE's answers), and the
GKE environment; garbage and impostors are clear errors; tpu:// references
are checked when applied. Agents started from such metadata:
tests/slice/test_tpu_vm.py."""

from __future__ import annotations

import time

import pytest

import remote_tpu
from conftest import free_port
from metadata_server import MetadataStandIn, tpu_vm
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu_agent.wire.discovery import MetadataServer, discover


@pytest.mark.parametrize("accelerator, n", [
    ("v4-16", 2), ("v5p-32", 4), ("v5litepod-16", 4), ("v6e-8", 1)])
def test_each_worker_discovers_itself_from_its_metadata_server(accelerator, n):
    hosts = [f"10.0.0.{i + 2}" for i in range(n)]
    for worker in range(n):
        server = tpu_vm(worker, hosts, accelerator)
        try:
            found = discover(port=8475, env={}, metadata=MetadataServer(server.address))
        finally:
            server.close()
        assert found.worker_id == worker and found.source == "metadata"
        assert found.peers == tuple(f"{h}:8475" for h in hosts)
        assert found.accelerator == accelerator
        assert all(flavor == "Google" for _, flavor in server.requests)


def test_new_style_endpoints_and_the_environment_as_gke_sets_it():
    server = MetadataStandIn({"agent-worker-number": "1",
                              "worker-network-endpoints": "t1k-w-0,t1k-w-1"})
    try:
        found = discover(port=9000, env={}, metadata=MetadataServer(server.address))
    finally:
        server.close()
    assert found.peers == ("t1k-w-0:9000", "t1k-w-1:9000") and found.accelerator == ""
    env = {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "a,b,c,d",
           "TPU_ACCELERATOR_TYPE": "v5p-32"}
    found = discover(port=8475, env=env, metadata=MetadataServer("127.0.0.1:9"))
    assert (found.worker_id, found.source, found.accelerator) == (2, "environment", "v5p-32")
    assert found.peers[2] == "c:8475"
    flags = discover(port=8475, worker_id=1, peers=("x:1", "y:1"), env=env)
    assert flags.source == "flags" and flags.worker_id == 1


@pytest.mark.parametrize("attributes, message", [
    ({"agent-worker-number": "abc", "worker-network-endpoints": "a"},
     "agent-worker-number 'abc' is not a worker index"),
    ({"agent-worker-number": "3", "worker-network-endpoints": "a,b"},
     "worker 3 is not among the 2 workers"),
    ({"agent-worker-number": "0", "worker-network-endpoints": "a:b"},
     "cannot read the endpoint 'a:b'"),
    ({"agent-worker-number": "0", "worker-network-endpoints": "a",
      "accelerator-type": "v9x-3"}, "unknown TPU version 'v9x'"),
    ({"agent-worker-number": "0"}, "no worker-network-endpoints"),
])
def test_garbage_metadata_is_a_clear_error(attributes, message):
    server = MetadataStandIn(attributes)
    try:
        with pytest.raises(ConfigurationError, match=message):
            discover(port=8475, env={}, metadata=MetadataServer(server.address))
    finally:
        server.close()


def test_not_a_metadata_server_slow_server_and_no_server():
    impostor = MetadataStandIn({"agent-worker-number": "0"}, flavor_header=False)
    slow = MetadataStandIn({"agent-worker-number": "0"}, delay=1.0)
    try:
        with pytest.raises(ConfigurationError, match="without the 'Metadata-Flavor: Google'"):
            discover(port=1, env={"GCE_METADATA_IP": impostor.address},
                     metadata=MetadataServer(impostor.address))
        start = time.monotonic()
        with pytest.raises(ConfigurationError, match="did not answer"):
            discover(port=1, env={"GCE_METADATA_IP": slow.address},
                     metadata=MetadataServer(slow.address, timeout=0.2, attempts=2))
        assert time.monotonic() - start < 3
    finally:
        impostor.close()
        slow.close()
    # The stand-in is faithful: without the header the real server refuses too.
    import urllib.error
    import urllib.request
    server = MetadataStandIn({"agent-worker-number": "0"})
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://{server.address}/computeMetadata/v1/instance/"
                                   "attributes/agent-worker-number", timeout=2)
        assert info.value.code == 403
    finally:
        server.close()
    # Not on a TPU VM at all (nothing listens): a one-host slice, quickly.
    found = discover(port=1, env={}, metadata=MetadataServer(f"127.0.0.1:{free_port()}",
                                                             timeout=0.2, attempts=1))
    assert found.source == "none" and found.peers == ()


@pytest.mark.parametrize("url, message", [
    ("tpu://", "not a TPU reference"),
    ("tpu://x", r"needs \?zone="),
    ("tpu://x?zone=z&colour=red", "unknown option 'colour'"),
    ("tpu://x?zone=z&port=http", "port 'http' is not a number"),
])
def test_bad_tpu_references_fail_when_applied(url, message):
    with pytest.raises(ConfigurationError, match=message):
        remote_tpu.run(accelerator="tpu-v4-16", hosts=url)


def test_the_address_peers_reach_is_the_one_the_slice_lists_for_this_worker():
    from remote_tpu_agent.wire.discovery import advertise_address
    assert advertise_address("0.0.0.0", "", "10.0.0.3") == "10.0.0.3"
    assert advertise_address("0.0.0.0", "10.9.9.9", "10.0.0.3") == "10.9.9.9"  # given wins
    assert advertise_address("10.0.0.7", "", "") == "10.0.0.7"
    assert advertise_address("[::1]") == "::1"
