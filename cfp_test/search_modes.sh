#!/usr/bin/env bash
# Profile/search modes of CFP's per-model test scripts:  cfp_test/search_modes.sh MODEL MODE [cfp options...]
#   MODEL: gpt | llama2 | moe | bert      MODE: profile | search | enum-benchmark
# Defaults are small enough for a CPU host with 8 simulated devices; any cfp option given after MODE overrides them.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL {profile|search|enum-benchmark} [cfp options...]" >&2
  exit 2
fi
model=$1; mode=$2; shift 2
case "$mode" in
  profile|search|enum-benchmark) ;;
  *) echo "$0: mode '$mode' is not one of profile, search, enum-benchmark" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
dump="${CFP_DUMP_DIR:-$root/dump/$model}"   # /dump/ is git-ignored
mkdir -p "$dump"
common=(--model "$model" --num-layers "${NUM_LAYERS:-2}" --batch-size "${BATCH_SIZE:-8}" --mesh "${MESH:-8}")
case "$mode" in
  profile) exec "$py" -m cfp.cli.main profile "${common[@]}" --dump-dir "$dump" --max-combinations 8 "$@" ;;
  search)  exec "$py" -m cfp.cli.main search "${common[@]}" --dump-dir "$dump" --max-combinations 8 \
             --memory-per-device "${MEMORY:-2GB}" --plan-out "$dump/plan.json" "$@" ;;
  enum-benchmark) exec "$py" -m cfp.cli.main enum-benchmark "${common[@]}" "$@" ;;
esac
