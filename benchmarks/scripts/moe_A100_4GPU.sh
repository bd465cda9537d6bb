#!/usr/bin/env bash
# moe on 4 x A100: measured on real GPUs when nvidia-smi shows them, else planned with the A100-PCIe-40G cost model;
# MODE=measured|estimate picks one (measured without the GPUs: on 4 simulated CPU devices). See
# run_gpu_benchmark.sh; overrides: MODE, CONFIG, NUM_LAYERS, BATCH_SIZE, MESH, MEMORY, PYTHON, ITERS.
MODEL=moe GPU=A100 NGPU=4 GPU_MODEL=A100-PCIe-40G \
CONFIG=${CONFIG:-paper} BATCH_SIZE=${BATCH_SIZE:-16} MESH=${MESH:-2x2} \
  exec "$(dirname "$0")/run_gpu_benchmark.sh" "$@"
