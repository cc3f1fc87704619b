#!/usr/bin/env bash
# Docker for kvrepro's docker-target tests, on a fresh Debian/Ubuntu machine (as root):
# installs docker.io, debootstrap and OpenSSH (the client for ssh:// hosts, the server the ssh
# test starts on 127.0.0.1) if missing, starts dockerd if no daemon answers, then builds (or
# reuses) the CPU base image kvrepro/vllm-openai-cpu:v<base>. Idempotent: a second run takes about
# a second. Called by scripts/test.sh after the project venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."

KVREPRO="${KVREPRO:-.venv/bin/kvrepro}"
BASE_VERSION="${KVREPRO_BASE_VERSION:-$(.venv/bin/python -c 'from kvrepro.matrix import load_matrix; print(load_matrix("matrix.yaml").matrix.base)')}"
DOCKERD_LOG="${DOCKERD_LOG:-/tmp/kvrepro-dockerd.log}"

missing=()
command -v docker >/dev/null || missing+=(docker.io)
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ssh >/dev/null || missing+=(openssh-client)      # ssh:// hosts
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)          # tests/test_docker_ssh.py's throwaway sshd
if ((${#missing[@]})); then
  echo "docker-setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(printf '%s\n' "${missing[@]}" | sort -u)
fi

answers() { docker info >/dev/null 2>&1; }
PIDFILE=/var/run/docker.pid

if ! answers && [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  # a dockerd is starting or shutting down: let it finish either way before deciding
  for _ in $(seq 1 30); do
    answers && break
    kill -0 "$(cat "$PIDFILE" 2>/dev/null || echo 0)" 2>/dev/null || break
    sleep 1
  done
fi

if ! answers; then
  if [ -f "$PIDFILE" ] && ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    rm -f "$PIDFILE"  # left by a daemon that died: it would stop the new one from starting
  fi
  for attempt in 1 2 3; do
    echo "docker-setup: starting dockerd (attempt $attempt, log: $DOCKERD_LOG)"
    nohup dockerd >>"$DOCKERD_LOG" 2>&1 &
    pid=$!
    for _ in $(seq 1 60); do
      answers && break 2
      kill -0 "$pid" 2>/dev/null || break  # it exited: look at why, maybe retry
      sleep 1
    done
    sleep 2
  done
  if ! answers; then
    echo "docker-setup: dockerd did not come up; last lines of $DOCKERD_LOG:" >&2
    tail -n 20 "$DOCKERD_LOG" >&2 || true
    exit 1
  fi
fi

echo "docker-setup: CPU base for vLLM $BASE_VERSION (built once, then reused)"
start=$(date +%s)
"$KVREPRO" images base-cpu --version "$BASE_VERSION"
echo "docker-setup: done in $(( $(date +%s) - start )) s"
