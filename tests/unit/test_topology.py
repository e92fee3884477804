"""Accelerator names follow Cloud TPU's documentation (see remote_tpu/_topology.py):
v2/v3/v4/v5p count TensorCores (2 per chip), v5e/v6e count chips; 4 chips per
host on multi-host slices, up to 8 chips on one v5e/v6e host."""

import dataclasses

import pytest

from remote_tpu import ConfigurationError, Topology


@pytest.mark.parametrize("name, chips, cores, hosts, per_host, devices_per_host", [
    # https://cloud.google.com/tpu/docs/v2 and /v3: 4 chips (8 cores, 8 JAX devices) per host
    ("tpu-v2-8", 4, 8, 1, 4, 8),
    ("tpu-v2-32", 16, 32, 4, 4, 8),
    ("tpu-v3-8", 4, 8, 1, 4, 8),
    ("tpu-v3-64", 32, 64, 8, 4, 8),
    # https://cloud.google.com/tpu/docs/v4: megacore, one JAX device per chip
    ("tpu-v4-8", 4, 8, 1, 4, 4),
    ("tpu-v4-16", 8, 16, 2, 4, 4),
    ("tpu-v4-32", 16, 32, 4, 4, 4),
    # https://cloud.google.com/tpu/docs/v5p
    ("tpu-v5p-8", 4, 8, 1, 4, 4),
    ("tpu-v5p-32", 16, 32, 4, 4, 4),
    ("tpu-v5p-128", 64, 128, 16, 4, 4),
    # https://cloud.google.com/tpu/docs/v5e: counts chips; up to 8 on one host
    ("tpu-v5litepod-1", 1, 1, 1, 1, 1),
    ("tpu-v5litepod-4", 4, 4, 1, 4, 4),
    ("tpu-v5litepod-8", 8, 8, 1, 8, 8),
    ("tpu-v5litepod-16", 16, 16, 4, 4, 4),
    ("tpu-v5litepod-256", 256, 256, 64, 4, 4),
    # https://cloud.google.com/tpu/docs/v6e
    ("tpu-v6e-8", 8, 8, 1, 8, 8),
    ("tpu-v6e-16", 16, 16, 4, 4, 4),
    ("tpu-v6e-64", 64, 64, 16, 4, 4),
    # https://cloud.google.com/tpu/docs/tpu7x: TensorCores (2 per chip, a JAX
    # device each), 4 chips per VM
    ("tpu7x-8", 4, 8, 1, 4, 8),
    ("tpu7x-32", 16, 32, 4, 4, 8),
    ("tpu7x-128", 64, 128, 16, 4, 8),
])
def test_documented_shapes(name, chips, cores, hosts, per_host, devices_per_host):
    t = Topology.parse(name)
    assert (t.chips, t.tensorcores, t.hosts, t.chips_per_host, t.devices_per_host) == \
        (chips, cores, hosts, per_host, devices_per_host)
    assert t.multi_host == (hosts > 1)
    assert t.name == name


def test_aliases_and_prefix_are_optional():
    assert Topology.parse("tpu-v5e-16") == Topology.parse("tpu-v5litepod-16")
    assert Topology.parse("v5p-32") == Topology.parse("tpu-v5p-32")
    assert Topology.parse("TPU-V4-16").name == "tpu-v4-16"


def test_topology_is_frozen():
    t = Topology.parse("tpu-v4-16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.hosts = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad, expected", [
    ("tpu-v5p-30", ["not a valid v5p size", "tensorcores", "tpu-v5p-24 or tpu-v5p-32"]),
    ("tpu-v5litepod-12", ["not a valid v5litepod size", "1, 4, 8, 16",
                          "tpu-v5litepod-8 or tpu-v5litepod-16"]),
    ("tpu-v2-16", ["tpu-v2-8 or tpu-v2-32"]),
    ("tpu-v6e-512", ["tpu-v6e-256"]),
    ("tpu-v7x-8", ["unknown TPU version 'v7x'", "v5litepod"]),
    ("v5p", ["not of the form", "tpu-v5p-32"]),
    ("", ["not of the form"]),
])
def test_invalid_names_explain_the_valid_forms(bad, expected):
    with pytest.raises(ConfigurationError) as info:
        Topology.parse(bad)
    for text in expected:
        assert text in str(info.value)


def test_non_string_is_rejected():
    with pytest.raises(ConfigurationError, match="must be a string"):
        Topology.parse(32)  # type: ignore[arg-type]


@pytest.mark.parametrize("name, accelerator, label, processes", [
    # https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus: the
    # node labels; the topologies of https://cloud.google.com/tpu/docs/v5p,
    # /v6e, /v4 and /tpu7x (tpu7x-32 is 2x2x4, 4 VMs).
    ("tpu-v5p-32", "tpu-v5p-slice", "2x2x4", 1),
    ("tpu-v5p-8", "tpu-v5p-slice", "2x2x1", 1),
    ("tpu-v4-16", "tpu-v4-podslice", "2x2x2", 1),
    ("tpu-v5litepod-16", "tpu-v5-lite-podslice", "4x4", 1),
    ("tpu-v6e-8", "tpu-v6e-slice", "2x4", 1),
    ("tpu-v6e-64", "tpu-v6e-slice", "8x8", 1),
    ("tpu7x-8", "tpu7x", "2x2x1", 2),
    ("tpu7x-32", "tpu7x", "2x2x4", 2),
    ("tpu7x-128", "tpu7x", "4x4x4", 2),
])
def test_gke_labels(name, accelerator, label, processes):
    t = Topology.parse(name)
    assert (t.gke_accelerator, t.topology_label, t.gke_processes_per_host) == \
        (accelerator, label, processes)


def test_tpu7x_keeps_clouds_own_name():
    assert Topology.parse("TPU7X-64").name == "tpu7x-64"
    with pytest.raises(ConfigurationError, match="tpu7x-8 or tpu7x-16"):
        Topology.parse("tpu7x-12")
