#!/usr/bin/env bash
# Runs the whole test suite (pytest): every tier of tests/ (unit, agent, and
# slice, whose multi-process tests are all marked slow).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
# REMOTE_TPU_DEPS=newest (or oldest) runs it against other versions of the
# dependencies, in a virtual environment of their own (scripts/_bootstrap.sh).
source "$(dirname "$0")/_bootstrap.sh"
exec "$VENV/bin/python" -m pytest -q --durations=15 "$@"
