#!/usr/bin/env bash
# Runs examples/quickstart.py on a local simulated tpu-v4-16 slice (2 hosts).
source "$(dirname "$0")/_bootstrap.sh"
exec "$VENV/bin/python" examples/quickstart.py "$@"
