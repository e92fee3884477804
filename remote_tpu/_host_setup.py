"""What ``remote-tpu setup`` runs on each host, over SSH: one bash script that
makes the host ready and (re)starts its agent, doing only what differs from
what it did last time.

Its standard input carries the slice token (the first line: never a command
line, which every user of the host can read, nor metadata) and then the
client's wheel. It reports its steps as ``@@ STEP`` lines (the rest is the
output of what it ran, kept for errors) and ends with ``@@done SUMMARY``.

On the host, under DIR (default ``~/.local/share/remote-tpu``):
``venv/`` the agent's Python environment, ``installed`` what was installed
there (written once pip succeeded), ``agent.state`` a digest of what the
running agent was started with (written once it listens: anything short of
that is done again next time), ``agent.pid`` and ``agent.log`` where no
systemd runs it, ``.lock`` (one setup at a time), ``uv-pip/`` or ``uv/`` and
``python/`` where uv had to bring a Python.
"""

from __future__ import annotations

import shlex

# Arguments: DIR PYTHON_MINOR WANT PIP_INDEX JAX_VERSION JAXLIB_VERSION PORT
# WHEEL_NAME AGENT_FLAGS... (WANT: what "installed" must say for the install to be skipped).
SCRIPT = r"""
set -euo pipefail
DIR=$1 MINOR=$2 WANT=$3 INDEX=$4 JAX=$5 JAXLIB=$6 PORT=$7 WHEEL_NAME=$8
shift 8
case "$DIR" in "~") DIR=$HOME;; "~/"*) DIR="$HOME/${DIR#"~/"}";; esac
step() { echo "@@ $*"; }
fail() { echo "@@failed $*"; exit 3; }
PIP_INDEX=()
[ -n "$INDEX" ] && PIP_INDEX=(--index-url "$INDEX")
case "$INDEX" in      # an index the client named over plain HTTP: trusted, as named
  http://*) TRUSTED=${INDEX#http://}; PIP_INDEX+=(--trusted-host "${TRUSTED%%/*}");;
esac

mkdir -p "$DIR"
chmod 700 "$DIR"
# One setup at a time on this host (one interrupted a moment ago may still be running).
exec 9>"$DIR/.lock"
flock -n 9 || fail "another remote-tpu setup is running on this host (an interrupted one" \
  "finishes its install first): wait a minute and run setup again"
umask 077
mkdir -p "$HOME/.config/remote_tpu"
IFS= read -r TOKEN || fail "no token came on standard input"
TOKEN_FILE="$HOME/.config/remote_tpu/token"
if [ ! -f "$TOKEN_FILE" ] || [ "$(cat "$TOKEN_FILE")" != "$TOKEN" ]; then
  printf '%s\n' "$TOKEN" > "$TOKEN_FILE.new" && mv "$TOKEN_FILE.new" "$TOKEN_FILE"
fi
chmod 700 "$HOME/.config/remote_tpu"; chmod 600 "$TOKEN_FILE"
cat > "$DIR/remote_tpu.whl.part"
umask 022

minor_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
find_uv() {
  for u in "$(command -v uv || true)" "$DIR/uv/uv" "$DIR/uv-pip/bin/uv"; do
    [ -n "$u" ] && [ -x "$u" ] && { UV=$u; return 0; }
  done
  step "installing uv (to bring Python $MINOR)"
  if command -v python3 >/dev/null && python3 -m pip install -q --disable-pip-version-check \
      "${PIP_INDEX[@]}" --target "$DIR/uv-pip" uv; then
    UV="$DIR/uv-pip/bin/uv"; return 0
  fi
  if command -v curl >/dev/null && curl -LsSf https://astral.sh/uv/install.sh |
      env UV_UNMANAGED_INSTALL="$DIR/uv" sh; then
    UV="$DIR/uv/uv"; return 0
  fi
  return 1
}
export UV_PYTHON_INSTALL_DIR="$DIR/python"

PY=""
for p in "$DIR/venv/bin/python" "python$MINOR" python3; do
  c=$(command -v "$p" || true)
  if [ -n "$c" ] && [ "$(minor_of "$c")" = "$MINOR" ]; then PY=$c; break; fi
done
if [ -z "$PY" ] && [ -d "$DIR/python" ]; then
  find_uv && PY=$("$UV" python find "$MINOR" 2>/dev/null) || PY=""
fi
if [ -z "$PY" ]; then
  find_uv || fail "no Python $MINOR on this host, and uv (to install one) could not be installed"
  step "installing Python $MINOR with uv"
  "$UV" python install "$MINOR" || fail "uv could not install Python $MINOR"
  PY=$("$UV" python find "$MINOR") || fail "uv installed Python $MINOR but cannot find it"
fi

if [ ! -x "$DIR/venv/bin/python" ] || [ "$(minor_of "$DIR/venv/bin/python")" != "$MINOR" ]; then
  step "making the agent's environment with $PY ($("$PY" --version 2>&1))"
  rm -rf "$DIR/venv" "$DIR/installed"
  if ! "$PY" -m venv "$DIR/venv"; then
    rm -rf "$DIR/venv"
    find_uv || fail "$PY cannot make a virtual environment (no venv module:" \
      "install python$MINOR-venv) and uv could not be installed"
    "$UV" venv --seed --python "$PY" "$DIR/venv" || fail "uv could not make a virtual environment"
  fi
fi

TPU=""
if ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then TPU=1; fi
if [ "$(cat "$DIR/installed" 2>/dev/null || true)" = "$WANT $TPU" ]; then
  step "remote-tpu, jax and jaxlib already as the client's"
else
  rm -f "$DIR/installed"
  NAMED="$DIR/$WHEEL_NAME"
  mv "$DIR/remote_tpu.whl.part" "$NAMED"
  if [ -n "$TPU" ]; then JAXES=("jax[tpu]==$JAX"); WHAT="jax[tpu] $JAX (a TPU is here)";
  else JAXES=("jax==$JAX" "jaxlib==$JAXLIB"); WHAT="jax $JAX (no TPU here)"; fi
  step "installing remote-tpu and $WHAT"
  "$DIR/venv/bin/python" -m pip install -q --disable-pip-version-check "${PIP_INDEX[@]}" \
    "$NAMED" "${JAXES[@]}" || fail "pip could not install remote-tpu and jax"
  "$DIR/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --force-reinstall "$NAMED" || fail "pip could not install the client's remote-tpu"
  rm -f "$NAMED"
  echo "$WANT $TPU" > "$DIR/installed"
fi
rm -f "$DIR/remote_tpu.whl.part"

ARGS=("$DIR/venv/bin/python" -m remote_tpu_agent --port "$PORT" "$@")
MODE=background
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null &&
   { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
  MODE=systemd; SUDO=(); [ "$(id -u)" = 0 ] || SUDO=(sudo -n)
fi
# What the running agent was started with, written once it listens: any
# difference (version, token, flags, how it runs) starts it again.
STATE=$(printf '%s\n' "$WANT $TPU" "$TOKEN" "$MODE" "$(printf '%q ' "${ARGS[@]}")" |
        sha256sum | cut -c1-32)
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }
ours() {   # pid $1 is an agent this setup started (a pid can be reused after a reboot)
  [ -n "$1" ] && [ -r "/proc/$1/cmdline" ] &&
    tr '\0' ' ' < "/proc/$1/cmdline" | grep -q -- "-m remote_tpu_agent"
}
PID=$(cat "$DIR/agent.pid" 2>/dev/null || true)
ours "$PID" || PID=""
UNIT_ACTIVE=""
if command -v systemctl >/dev/null && systemctl is-active -q remote-tpu-agent 2>/dev/null; then
  UNIT_ACTIVE=1
fi
if [ "$MODE" = systemd ]; then RUNNING=$UNIT_ACTIVE; else RUNNING=$PID; fi
if [ "$(cat "$DIR/agent.state" 2>/dev/null || true)" = "$STATE" ] && [ -n "$RUNNING" ] &&
   listening; then
  step "the agent is running, unchanged"
  echo "@@done unchanged"; exit 0
fi
rm -f "$DIR/agent.state"
if [ -n "$PID" ]; then
  step "stopping the old agent (pid $PID)"
  kill "$PID" 2>/dev/null || true
  for _ in $(seq 150); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$PID" 2>/dev/null || true
  rm -f "$DIR/agent.pid"
fi
if [ "$MODE" = systemd ]; then
  step "starting the agent under systemd (remote-tpu-agent.service)"
  "${SUDO[@]}" env HOME="$HOME" "${ARGS[@]:0:3}" install-service --user "$(id -un)" \
    --port "$PORT" "$@" || fail "could not install the systemd unit"
  "${SUDO[@]}" systemctl restart remote-tpu-agent || fail "systemd could not start the agent"
  LOG="journalctl -u remote-tpu-agent"
  started() { systemctl is-active -q remote-tpu-agent && listening; }
  died() { systemctl is-failed -q remote-tpu-agent; }
  last_lines() {
    "${SUDO[@]}" journalctl -u remote-tpu-agent -n 20 --no-pager 2>/dev/null || true
  }
else
  if [ -n "$UNIT_ACTIVE" ]; then
    fail "an agent runs here under systemd (remote-tpu-agent.service), which setup cannot" \
      "stop without root or passwordless sudo: stop it (sudo systemctl disable --now" \
      "remote-tpu-agent) and run setup again"
  fi
  step "starting the agent (no systemd here: in the background, until the host restarts)"
  # (Not holding the setup lock: fd 9 stays here.)
  setsid nohup "${ARGS[@]}" > "$DIR/agent.log" 2>&1 < /dev/null 9>&- &
  PID=$!
  echo "$PID" > "$DIR/agent.pid"
  LOG="$DIR/agent.log"
  # Its own line, not any listener on the port: another process may hold it.
  started() { grep -q "^remote-tpu-agent listening on" "$DIR/agent.log" 2>/dev/null &&
              kill -0 "$PID" 2>/dev/null; }
  died() { ! kill -0 "$PID" 2>/dev/null; }
  last_lines() { tail -n 20 "$DIR/agent.log" 2>/dev/null || true; }
fi
for _ in $(seq 600); do
  if started; then echo "$STATE" > "$DIR/agent.state"; echo "@@done started"; exit 0; fi
  if died; then last_lines; fail "the agent exited at start (its log: $LOG)"; fi
  sleep 0.1
done
last_lines
fail "the agent did not listen on port $PORT within 60 s (its log: $LOG)"
"""


def remote_command(directory: str, python_minor: str, want: str, pip_index: str,
                   jax: str, jaxlib: str, port: int, wheel_name: str,
                   agent_flags: list[str]) -> str:
    """The command line ssh runs on the host (it holds no secret)."""
    return "bash -c " + shlex.quote(SCRIPT) + " remote-tpu-setup " + shlex.join(
        [directory, python_minor, want, pip_index, jax, jaxlib, str(port), wheel_name,
         *agent_flags])
