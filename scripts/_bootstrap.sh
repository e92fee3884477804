# Sourced by scripts/quickstart.sh and scripts/test.sh: make .venv with
# remote_tpu and its test dependencies installed, once; reinstall when
# pyproject.toml changes. Needs python3 >= 3.11 on PATH (or $PYTHON).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "remote_tpu needs Python 3.11 or newer; '$PYTHON' is $("$PYTHON" --version 2>&1 || echo missing)." >&2
  echo "Install one, or point PYTHON=/path/to/python3.11 at it." >&2
  exit 2
fi
stamp=.venv/.installed-$("$PYTHON" -c 'import hashlib,sys; print(hashlib.sha1(open("pyproject.toml","rb").read()).hexdigest()[:12])')
if [ ! -f "$stamp" ]; then
  echo "Setting up .venv (first run only; installs jax, grpcio and friends)..." >&2
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q -e ".[test]" >&2
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# Our own modules, byte-compiled (a moment, and nothing when they are up to
# date): with PYTHONDONTWRITEBYTECODE set Python reads .pyc files but writes
# none, and every agent, worker and client would compile them from source as it
# starts (0.1 s of CPU for each agent; 64 simulated hosts start 64). Only a
# saving: a checkout it cannot write to runs as well without it.
.venv/bin/python -m compileall -q remote_tpu agent >/dev/null 2>&1 || true
export PATH="$PWD/.venv/bin:$PATH"
