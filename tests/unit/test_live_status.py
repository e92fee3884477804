"""The live status line on its own (remote_tpu/_status.py): a phase shows
once it has lasted a second, progress updates it, a closed line says nothing
more. On a real terminal, with real agents: tests/slice/test_status.py."""

from __future__ import annotations

import re
import time

from conftest import wait_until


def test_a_phase_shows_once_it_lasts_and_its_progress_updates_it(capsys):
    from remote_tpu import _status

    status = _status.LiveStatus(processes=4, enabled=True)
    status.phase("remote_tpu: waiting for the slice")
    time.sleep(0.5)
    assert capsys.readouterr().err == ""                     # not yet: under a second
    started = time.monotonic() - 2
    status.uploading(300_000_000, 1_000_000_000, started)    # a new phase: its own second
    said: list[str] = []

    def shown(pattern: str) -> bool:
        said.append(capsys.readouterr().err)
        return re.search(pattern, "".join(said)) is not None
    assert wait_until(lambda: shown(r"remote_tpu: uploading 300\.0 MB of 1\.0 GB "
                                    r"\(150\.0 MB/s\)"), timeout=5), said
    said.clear()
    status.started(4)
    assert wait_until(lambda: shown(r"remote_tpu: 4 processes started, initializing JAX; "
                                    r"no output yet \[[12] s\]"), timeout=5), said
    status.close()
    assert capsys.readouterr().err.endswith("\r")            # the line erased
    status.phase("remote_tpu: queued behind job-1")          # closed: never again
    time.sleep(1.5)
    assert capsys.readouterr().err == ""
