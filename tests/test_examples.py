"""The workload examples, run as a user runs them: each asserts its own result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _example(name: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_data_loader_assembles_every_hosts_shard_into_one_global_array():
    out = _example("data_loader.py").stdout
    assert "host 0: 64 of 128 rows here" in out
    assert "returned to the caller: {'rows': 128, 'sum': 24384.0" in out
