#!/usr/bin/env bash
# Run the three CFP modes (analysis, profile, search) for one model and check each one's key output:
#   cfp_test/scripts/functionality_check.sh MODEL [--num_layer 2] [--batch_size 16] [extra cfp options]
# Environment as cfp_test/run_mode.sh (MESH, CONFIG, CFP), and PROFILE_OPTIONS: extra cfp options of the profile
# and search modes only, e.g. "--profiler estimate --gpu A100-SXM-80G --max-combinations 2" (split on spaces).
# Exit status 0 only when all three modes pass.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model="${1:?usage: functionality_check.sh MODEL [--num_layer N] [--batch_size B] [extra cfp options]}"; shift
num_layer=2; batch_size=16; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --num_layer|--num-layers) num_layer="$2"; shift 2 ;;
    --batch_size|--batch-size) batch_size="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT
failed=0
check() {   # check MODE NEEDLE [options of that mode]
  local mode="$1" needle="$2"; shift 2
  local t0=$SECONDS
  if "$here/../run_mode.sh" "$model" --num_layer "$num_layer" --batch_size "$batch_size" --mode "$mode" \
       "$@" ${extra[@]+"${extra[@]}"} >"$log/$mode.txt" 2>&1 && grep -q "$needle" "$log/$mode.txt"; then
    echo "PASS $model $mode ($((SECONDS - t0)) s): $(grep -m1 "$needle" "$log/$mode.txt")"
  else
    echo "FAIL $model $mode ($((SECONDS - t0)) s); last lines:"
    tail -n 15 "$log/$mode.txt" | sed 's/^/    /'
    failed=1
  fi
}
check analysis "global analysis time"
read -r -a profile_options <<< "${PROFILE_OPTIONS:-}"
check profile "profile time:" --no-progress ${profile_options[@]+"${profile_options[@]}"}
check search "searched ParallelBlock Strategies solution" --no-progress ${profile_options[@]+"${profile_options[@]}"}
exit $failed
