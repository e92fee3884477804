#!/usr/bin/env bash
# Runs the whole test suite (pytest), slow multi-process tests included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
source "$(dirname "$0")/_bootstrap.sh"
exec .venv/bin/python -m pytest -q --durations=15 "$@"
