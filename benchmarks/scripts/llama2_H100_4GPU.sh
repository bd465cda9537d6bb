#!/usr/bin/env bash
# llama2 on 4 x H100: measured on real GPUs when nvidia-smi shows them, else planned with the H100-SXM cost model;
# MODE=measured|estimate picks one (measured without the GPUs: on 4 simulated CPU devices). See
# run_gpu_benchmark.sh; overrides: MODE, CONFIG, NUM_LAYERS, BATCH_SIZE, MESH, MEMORY, PYTHON, ITERS.
MODEL=llama2 GPU=H100 NGPU=4 GPU_MODEL=H100-SXM \
CONFIG=${CONFIG:-7B} BATCH_SIZE=${BATCH_SIZE:-16} MESH=${MESH:-2x2} \
  exec "$(dirname "$0")/run_gpu_benchmark.sh" "$@"
