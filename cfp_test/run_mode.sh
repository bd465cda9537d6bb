#!/usr/bin/env bash
# Run one CFP mode for one model, like the paper's cfp_test scripts:
#   cfp_test/run_mode.sh MODEL --num_layer 4 --batch_size 64 --mode analysis|profile|search [extra cfp options]
# Environment: MESH (default 8), CONFIG (default tiny), CFP (the cfp executable; default: the repo's .venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
model="${1:?usage: run_mode.sh MODEL --num_layer N --batch_size B --mode MODE}"; shift
num_layer=4; batch_size=64; mode=analysis; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --num_layer|--num-layers) num_layer="$2"; shift 2 ;;
    --batch_size|--batch-size) batch_size="$2"; shift 2 ;;
    --mode) mode="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
case "$mode" in analysis|profile|search) ;; *) echo "run_mode.sh: error: --mode '$mode' is not one of analysis, profile, search" >&2; exit 2 ;; esac
cfp="${CFP:-$root/.venv/bin/cfp}"
[ -x "$cfp" ] || cfp="$(command -v cfp || true)"
[ -n "$cfp" ] || { echo "run_mode.sh: error: no cfp executable; run 'make install' first" >&2; exit 2; }
dump="$here/$model/debug_${mode}"
echo "============ $model test: mode:$mode config:${CONFIG:-tiny} batchsize:$batch_size layers:$num_layer mesh:${MESH:-8} ============"
exec "$cfp" "$mode" --model "$model" --config "${CONFIG:-tiny}" --num-layers "$num_layer" \
  --batch-size "$batch_size" --mesh "${MESH:-8}" --dump-dir "$dump" "${extra[@]}"
