#!/usr/bin/env bash
# llama2: cfp_test/llama2/llama2_test.sh --num_layer 4 --batch_size 64 --mode analysis|profile|search
exec "$(dirname "$0")/../run_mode.sh" llama2 "$@"
