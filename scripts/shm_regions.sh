#!/usr/bin/env bash
# vLLM's /dev/shm offload regions left by `kvrepro matrix run`, on this checkout (docs/signals-and-cleanup.md):
#
#     bash scripts/shm_regions.sh [full|sigkill|default]
#
# full:    matrix.yaml with multi-tier offloading (TieringOffloadingSpec + one fs tier, 0.25 GiB CPU
#          tier, 40 requests, 1 repetition), builds A-E, run to its end;
# sigkill: the same matrix, build D, `kill -KILL` of kvrepro once its engine made its region;
# default: the default matrix.yaml (40 requests, 1 repetition).
# It prints the regions the run's engine logs name (vLLM's "Created mmap file" line) and those still
# in /dev/shm 30 s after the command ended (counts only this run's: others may run engines here),
# then removes those. For "before", run it in a checkout of the earlier commit with this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvrepro-shm-XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -r builds "$work/builds"
.venv/bin/python - "$mode" "$work" <<'PY'
import json, sys, yaml
mode, work = sys.argv[1], sys.argv[2]
data = yaml.safe_load(open("matrix.yaml"))
data["runs"].update(repetitions=1, requests=40)
if mode != "default":
    data["engine"]["kv_offloading_size_gib"] = 0.25
    tiers = [{"type": "fs", "root_dir": f"{work}/fs"}]
    data["engine"]["extra_args"] = ["--kv-transfer-config", json.dumps(
        {"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}})]
yaml.safe_dump(data, open(f"{work}/matrix.yaml", "w"), sort_keys=False)
PY
regions() { grep -rhoE "/dev/shm/vllm_offload_[A-Za-z0-9_-]+\.mmap" "$work/r" 2>/dev/null | sort -u || true; }
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$mode" = sigkill ]; then
  .venv/bin/kvrepro matrix run -m "$work/matrix.yaml" -b D --results "$work/r" >"$work/out" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    [ -n "$(regions)" ] && break
    kill -0 "$pid" 2>/dev/null || { echo "kvrepro ended before its engine made a region"; tail -3 "$work/out"; exit 1; }
    sleep 1
  done
  sleep 3
  kill -KILL "$pid"
  wait "$pid" 2>/dev/null || true
else
  .venv/bin/kvrepro matrix run -m "$work/matrix.yaml" --results "$work/r" >"$work/out" 2>&1 || true
fi
sleep 30
named=0 left=0 bytes=0
for f in $(regions); do
  named=$((named + 1))
  if [ -f "$f" ] && [ ! -L "$f" ]; then
    left=$((left + 1)); bytes=$((bytes + $(stat -c %s "$f")))
    echo "left: $f ($(grep -rl "$f" "$work/r" | head -1 | sed "s#$work/r/##"))"
    rm -f "$f"
  fi
done
echo "$mode: regions named $named, left $left ($bytes bytes)"
