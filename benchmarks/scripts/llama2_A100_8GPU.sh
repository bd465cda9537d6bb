#!/usr/bin/env bash
# llama2 on 8 x A100: measured on real GPUs when nvidia-smi shows them, else planned with the A100-PCIe-40G cost model;
# MODE=measured|estimate picks one (measured without the GPUs: on 8 simulated CPU devices). See
# run_gpu_benchmark.sh; overrides: MODE, CONFIG, NUM_LAYERS, BATCH_SIZE, MESH, MEMORY, PYTHON, ITERS.
MODEL=llama2 GPU=A100 NGPU=8 GPU_MODEL=A100-PCIe-40G \
CONFIG=${CONFIG:-7B} BATCH_SIZE=${BATCH_SIZE:-32} MESH=${MESH:-2x4} \
  exec "$(dirname "$0")/run_gpu_benchmark.sh" "$@"
