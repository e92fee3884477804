"""The layout of every process's values joined (all_results=), and the option."""

from __future__ import annotations

import pytest

import remote_tpu
from remote_tpu._core import value_list
from remote_tpu._core.exceptions import ConfigurationError
from remote_tpu._core.serialization import dumps
from remote_tpu._outcome import value_of

pytestmark = pytest.mark.timeout(30)


def _joined(values: list) -> bytes:
    parts = [dumps(v).to_bytes() for v in values]
    return value_list.header([len(p) for p in parts]) + b"".join(parts)


@pytest.mark.parametrize("values", [[], [None], [1, "two", b"\0" * 3, {"k": [4]}]])
def test_joined_values_come_apart_in_order(values):
    assert value_of(_joined(values), "job-1") == values


def test_a_plain_value_is_not_taken_for_a_list():
    data = dumps([1, 2]).to_bytes()
    assert value_list.split(data) is None
    assert value_of(data, "job-1") == [1, 2]


@pytest.mark.parametrize("cut", [1, 9, 20])
def test_a_list_cut_short_or_too_long_is_refused(cut):
    data = _joined([1, 2])
    for bad in (data[:-cut], data + b"\0" * cut):
        with pytest.raises(remote_tpu.SerializationError, match="nothing was unpickled"):
            value_of(bad, "job-1")


def test_the_option_takes_true_false_and_its_variable(monkeypatch):
    on = lambda **kw: remote_tpu.run(accelerator="tpu-v4-8", **kw)(lambda: 0).options  # noqa: E731
    assert on().all_results is False and on(all_results=True).all_results is True
    monkeypatch.setenv("REMOTE_TPU_ALL_RESULTS", "1")
    assert on().all_results is True and on(all_results=False).all_results is False
    monkeypatch.setenv("REMOTE_TPU_ALL_RESULTS", "maybe")
    with pytest.raises(ConfigurationError, match="REMOTE_TPU_ALL_RESULTS"):
        on()
    monkeypatch.delenv("REMOTE_TPU_ALL_RESULTS")
    with pytest.raises(ConfigurationError, match="all_results= must be True or False"):
        on(all_results="yes")
