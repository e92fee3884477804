#!/usr/bin/env bash
# Runs the whole test suite (pytest): every tier of tests/ (unit, agent, and
# slice, whose multi-process tests are all marked slow).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
# Two pytest workers (pytest-xdist), each module's tests on one of them: most
# tests wait on processes more than they use the CPU (13 min on one worker,
# under 9 on two, on 2 cores). REMOTE_TPU_TEST_WORKERS=0 runs them in this
# process (a debugger, say).
# REMOTE_TPU_DEPS=newest (or oldest) runs it against other versions of the
# dependencies, in a virtual environment of their own (scripts/_bootstrap.sh).
source "$(dirname "$0")/_bootstrap.sh"
exec "$VENV/bin/python" -m pytest -q --durations=15 \
  -n "${REMOTE_TPU_TEST_WORKERS:-2}" --dist loadscope "$@"
