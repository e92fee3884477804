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
# The setup tests' "TPU VMs" each run a real sshd (Debian's openssh-server);
# where this runs as root with apt and none is installed, install it (else they skip).
if [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "Installing openssh-server for the setup tests (once)..." >&2
  export DEBIAN_FRONTEND=noninteractive
  { timeout 300 apt-get install -y -q --no-install-recommends openssh-server ||
    { timeout 300 apt-get update -q && timeout 300 apt-get install -y -q \
        --no-install-recommends openssh-server; }; } >/dev/null 2>&1 ||
    echo "(could not install it: the setup tests will skip)" >&2
fi
exec "$VENV/bin/python" -m pytest -q --durations=15 \
  -n "${REMOTE_TPU_TEST_WORKERS:-2}" --dist loadscope "$@"
