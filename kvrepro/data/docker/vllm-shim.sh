#!/bin/sh
# kvrepro CPU base: the image's `vllm` command.
#
# Every command is vLLM's own CLI. When the container sees no NVIDIA GPU (or KVREPRO_ENGINE=sim),
# kvrepro's vLLM platform plugin is switched on (KVREPRO_SIM=1): vLLM's own `vllm serve` then
# runs GPU-free (vLLM's scheduler, KV-cache manager and OffloadingConnector with a fake model
# executor), so the same `docker run IMAGE MODEL ARGS` works on a laptop, in CI and on a GPU
# node. KVREPRO_ENGINE=vllm leaves the plugin off whatever the hardware.
mode="${KVREPRO_ENGINE:-auto}"
if [ "$mode" != "vllm" ]; then
  if [ "$mode" = "sim" ] || ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    export KVREPRO_SIM=1
    # EngineCore forked from the API server reuses its imports (vLLM >= 0.30 would spawn)
    export VLLM_WORKER_MULTIPROC_METHOD="${VLLM_WORKER_MULTIPROC_METHOD:-fork}"
  fi
fi
exec /usr/local/bin/vllm-upstream "$@"
