#!/usr/bin/env bash
# moe: cfp_test/moe/moe_test.sh --num_layer 4 --batch_size 64 --mode analysis|profile|search
exec "$(dirname "$0")/../run_mode.sh" moe "$@"
