#!/usr/bin/env bash
# gpt: cfp_test/gpt/gpt_test.sh --num_layer 4 --batch_size 64 --mode analysis|profile|search
exec "$(dirname "$0")/../run_mode.sh" gpt "$@"
