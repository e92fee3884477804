#!/usr/bin/env bash
# Raises deps/locked.txt to the newest releases, once the suite passes on them:
# runs it in .venv-newest (REMOTE_TPU_DEPS=newest), then writes what that
# environment has. Review and commit the change to deps/locked.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
REMOTE_TPU_DEPS=newest bash scripts/test.sh "$@"
{ sed -n '1,/^# newest releases/p' deps/locked.txt
  .venv-newest/bin/python -m pip freeze --exclude-editable; } > deps/locked.txt.new
mv deps/locked.txt.new deps/locked.txt
echo "deps/locked.txt now holds the versions the suite just passed with." >&2
