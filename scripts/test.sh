#!/usr/bin/env bash
# Sets up everything kvrepro's tests need on a fresh Debian machine (as root), then runs them:
# system packages (patch, openssh, docker.io, debootstrap), a running dockerd, the project venv,
# the runtime env with vLLM's dependencies and the A-D overlays, the CPU base image for the docker target.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v patch >/dev/null || missing+=(patch)
command -v ssh >/dev/null || missing+=(openssh-client)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)   # tests/test_docker_ssh.py starts its own sshd on 127.0.0.1
if ((${#missing[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,ray]'   # ray: tests/test_ray_target.py
.venv/bin/kvrepro setup

if [ -f .ci/docker-setup.sh ]; then
  bash .ci/docker-setup.sh
fi

# two xdist workers (docs/ci.md#kvrepros-own-tests): tests that use something machine-wide (the Docker
# daemon, loopback Ray raylets) share one worker, in the xdist group "exclusive"; `-n 0` runs serially
.venv/bin/python -m pytest -n "${KVREPRO_TEST_WORKERS:-2}" --dist loadgroup -v -rfEs --durations=60 tests "$@"
