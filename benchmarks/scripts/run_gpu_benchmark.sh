#!/usr/bin/env bash
# Shared body of the per-GPU benchmark scripts: MODEL GPU NGPU GPU_MODEL CONFIG BATCH_SIZE MESH come from the
# caller. Two modes (MODE; default auto: measured when nvidia-smi shows >= NGPU GPUs of that kind, else estimate):
#   measured  benchmarks/compare.py: baselines, alpa-ilp and cfp compiled and timed side by side, the ILP priced
#             with the GPU_MODEL cost model. On those GPUs when they are there; without them on NGPU simulated
#             CPU devices (the figures are then this host's CPU times, not the GPU's), so the path runs anywhere.
#   estimate  plan with the GPU_MODEL cost model ('cfp search --profiler estimate') on simulated CPU devices.
# Says which it did. Arguments given to the script go to the mode's command (compare.py or cfp search), after
# its own. Overrides: MODE, CONFIG, NUM_LAYERS, BATCH_SIZE, MESH, MEMORY (per-device budget, e.g. 40GB), PYTHON,
# ITERS.
set -euo pipefail
: "${MODEL:?}" "${GPU:?}" "${NGPU:?}" "${GPU_MODEL:?}" "${CONFIG:?}" "${BATCH_SIZE:?}" "${MESH:?}"
cd "$(dirname "$0")/../.."
NUM_LAYERS=${NUM_LAYERS:-4}
ITERS=${ITERS:-5}
MODE=${MODE:-auto}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MEM_ARGS=()
if [ -n "${MEMORY:-}" ]; then MEM_ARGS=(--memory-per-device "$MEMORY"); fi

found=0
if command -v nvidia-smi >/dev/null 2>&1; then
  found=$(nvidia-smi -L 2>/dev/null | grep -c "$GPU" || true)
fi
case "$MODE" in
  auto) if [ "$found" -ge "$NGPU" ]; then MODE=measured; else MODE=estimate; fi ;;
  measured|estimate) ;;
  *) echo "run_gpu_benchmark.sh: error: MODE=$MODE is not one of auto, measured, estimate" >&2; exit 2 ;;
esac
COMPARE=(benchmarks/compare.py --model "$MODEL" --config "$CONFIG" --num-layers "$NUM_LAYERS"
         --batch-size "$BATCH_SIZE" --mesh "$MESH" --iters "$ITERS" --gpu "$GPU_MODEL" ${MEM_ARGS[@]+"${MEM_ARGS[@]}"})
if [ "$MODE" = measured ] && [ "$found" -ge "$NGPU" ]; then
  echo "mode: measured on real GPUs ($found x $GPU visible, using $NGPU): comparison of $MODEL/$CONFIG on mesh $MESH"
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NGPU - 1)))
  exec "$PYTHON" "${COMPARE[@]}" "$@"
elif [ "$MODE" = measured ]; then
  echo "mode: measured on $NGPU simulated CPU devices ($found x $GPU visible, need $NGPU): comparison of" \
       "$MODEL/$CONFIG on mesh $MESH, the ILP priced with the $GPU_MODEL cost model; times are this host's"
  flags=$(printf '%s' "${XLA_FLAGS:-}" | sed 's/--xla_force_host_platform_device_count=[0-9]*//g')
  exec env JAX_PLATFORMS=cpu XLA_FLAGS="$flags --xla_force_host_platform_device_count=$NGPU" \
    "$PYTHON" "${COMPARE[@]}" "$@"
else
  echo "mode: cost-model estimate ($found x $GPU visible, need $NGPU): planning $MODEL/$CONFIG on mesh $MESH" \
       "with the $GPU_MODEL cost model on simulated CPU devices; no step is run on a GPU"
  exec env JAX_PLATFORMS=cpu "$PYTHON" -m cfp.cli.main search --model "$MODEL" --config "$CONFIG" \
    --num-layers "$NUM_LAYERS" --batch-size "$BATCH_SIZE" --mesh "$MESH" --profiler estimate --gpu "$GPU_MODEL" \
    ${MEM_ARGS[@]+"${MEM_ARGS[@]}"} "$@"
fi
