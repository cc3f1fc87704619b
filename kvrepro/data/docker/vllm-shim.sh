#!/bin/sh
# kvrepro CPU base: the image's `vllm` command.
#
# `vllm serve MODEL ARGS` starts kvrepro's GPU-free engine (vLLM's real scheduler, KV cache
# manager and OffloadingConnector scheduler with a fake executor) when the container sees no
# NVIDIA GPU, so the same `docker run IMAGE MODEL ARGS` works on a laptop and in CI. With a GPU,
# or KVREPRO_ENGINE=vllm, every command goes to vLLM's own CLI unchanged; KVREPRO_ENGINE=sim
# forces the GPU-free engine.
mode="${KVREPRO_ENGINE:-auto}"
if [ "$1" = "serve" ] && [ "$mode" != "vllm" ]; then
  if [ "$mode" = "sim" ] || ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    shift
    exec python3 -m kvrepro.engine "$@"
  fi
fi
exec /usr/local/bin/vllm-upstream "$@"
