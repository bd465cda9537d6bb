#!/usr/bin/env bash
# Shared body of the per-GPU benchmark scripts: MODEL GPU NGPU GPU_MODEL CONFIG BATCH_SIZE MESH come from the
# caller. On real GPUs (nvidia-smi shows >= NGPU of that kind) run benchmarks/compare.py (baselines, alpa-ilp
# and cfp timed side by side); otherwise plan with the GPU_MODEL cost model ('cfp search --profiler estimate')
# on simulated CPU devices. Says which it did.
# Overrides: CONFIG, NUM_LAYERS, BATCH_SIZE, MESH, MEMORY (per-device budget, e.g. 40GB), PYTHON, ITERS.
set -euo pipefail
: "${MODEL:?}" "${GPU:?}" "${NGPU:?}" "${GPU_MODEL:?}" "${CONFIG:?}" "${BATCH_SIZE:?}" "${MESH:?}"
cd "$(dirname "$0")/../.."
NUM_LAYERS=${NUM_LAYERS:-4}
ITERS=${ITERS:-5}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MEM_ARGS=()
if [ -n "${MEMORY:-}" ]; then MEM_ARGS=(--memory-per-device "$MEMORY"); fi

found=0
if command -v nvidia-smi >/dev/null 2>&1; then
  found=$(nvidia-smi -L 2>/dev/null | grep -c "$GPU" || true)
fi
if [ "$found" -ge "$NGPU" ]; then
  echo "mode: real GPUs ($found x $GPU visible, using $NGPU): measured comparison of $MODEL/$CONFIG on mesh $MESH"
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NGPU - 1)))
  exec "$PYTHON" benchmarks/compare.py --model "$MODEL" --config "$CONFIG" --num-layers "$NUM_LAYERS" \
    --batch-size "$BATCH_SIZE" --mesh "$MESH" --iters "$ITERS" --gpu "$GPU_MODEL" ${MEM_ARGS[@]+"${MEM_ARGS[@]}"}
else
  echo "mode: cost-model estimate ($found x $GPU visible, need $NGPU): planning $MODEL/$CONFIG on mesh $MESH" \
       "with the $GPU_MODEL cost model on simulated CPU devices; no step is run on a GPU"
  exec env JAX_PLATFORMS=cpu "$PYTHON" -m cfp.cli.main search --model "$MODEL" --config "$CONFIG" \
    --num-layers "$NUM_LAYERS" --batch-size "$BATCH_SIZE" --mesh "$MESH" --profiler estimate --gpu "$GPU_MODEL" \
    ${MEM_ARGS[@]+"${MEM_ARGS[@]}"}
fi
