# Sourced by scripts/quickstart.sh and scripts/test.sh: make a virtual
# environment with remote_tpu and its test dependencies installed, once, and
# again when pyproject.toml or the pinned versions change. Needs python3 >= 3.11
# on PATH (or $PYTHON). Sets VENV to it.
#
# REMOTE_TPU_DEPS picks the versions:
#   locked (default)  .venv,        the versions in deps/locked.txt
#   newest            .venv-newest, the newest release of everything (again each day)
#   oldest            .venv-oldest, the oldest core dependencies pyproject.toml
#                     allows (deps/oldest.txt), the rest what they accept
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "remote_tpu needs Python 3.11 or newer; '$PYTHON' is $("$PYTHON" --version 2>&1 || echo missing)." >&2
  echo "Install one, or point PYTHON=/path/to/python3.11 at it." >&2
  exit 2
fi
case "${REMOTE_TPU_DEPS:-locked}" in
  locked) VENV=.venv;        pins=(-c deps/locked.txt); fresh="" ;;
  newest) VENV=.venv-newest; pins=(--upgrade --upgrade-strategy eager); fresh=$(date +%F) ;;
  oldest) VENV=.venv-oldest; pins=(-c deps/oldest.txt); fresh="" ;;
  *) echo "REMOTE_TPU_DEPS=${REMOTE_TPU_DEPS} is not one of: locked (default), newest, oldest." >&2
     exit 2 ;;
esac
stamp=$VENV/.installed-$(cat pyproject.toml deps/locked.txt deps/oldest.txt <(echo "$fresh") |
  "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha1(sys.stdin.buffer.read()).hexdigest()[:12])')
if [ ! -f "$stamp" ]; then
  echo "Setting up $VENV (first run only; installs jax, grpcio and friends)..." >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q "${pins[@]}" -e ".[test]" >&2
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
# Our own modules, byte-compiled (a moment, and nothing when they are up to
# date): with PYTHONDONTWRITEBYTECODE set Python reads .pyc files but writes
# none, and every agent, worker and client would compile them from source as it
# starts (0.1 s of CPU for each agent; 64 simulated hosts start 64). Only a
# saving: a checkout it cannot write to runs as well without it.
"$VENV/bin/python" -m compileall -q remote_tpu agent >/dev/null 2>&1 || true
export PATH="$PWD/$VENV/bin:$PATH"
