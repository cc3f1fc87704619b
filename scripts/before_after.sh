#!/usr/bin/env bash
# The default matrix on an earlier commit and on this checkout, interleaved, with the same venv:
# wall time, exit code, load average and the verdict rows of each run, side by side.
#
#     bash scripts/before_after.sh REV [ROUNDS]      # e.g. scripts/before_after.sh e2fdda2 2
#
# Used to show that a change (e.g. issue 17's restructuring) left the verdicts and the wall time
# of the default matrix as they were. The earlier commit runs from a detached worktree under
# $TMPDIR (removed at the end); both write their runs under their own results/.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/before_after.sh REV [ROUNDS]}
rounds=${2:-2}
here=$(pwd)
py="$here/.venv/bin/python"
before=$(mktemp -d "${TMPDIR:-/tmp}/kvrepro-before-XXXXXX")
trap 'git -C "$here" worktree remove --force "$before" >/dev/null 2>&1 || rm -rf "$before"' EXIT INT TERM
git worktree add --detach "$before" "$rev" -q
run() {  # $1 label, $2 folder
  local out start end rc=0
  out=$(mktemp "${TMPDIR:-/tmp}/kvrepro-ba-XXXXXX")
  start=$(date +%s.%N)
  (cd "$2" && COLUMNS=200 "$py" -m kvrepro.cli matrix run >"$out" 2>&1) || rc=$?
  end=$(date +%s.%N)
  printf '%-6s exit=%s wall=%6.1f s  load=%s\n' "$1" "$rc" "$(echo "$end - $start" | bc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
  grep -E '^[│|] +[A-Z] ' "$out" | sed 's/^/         /' | cut -c1-110 || true
  rm -f "$out"
}
for ((i = 0; i < rounds; i++)); do
  if ((i % 2 == 0)); then run before "$before"; run after "$here"; else run after "$here"; run before "$before"; fi
done
