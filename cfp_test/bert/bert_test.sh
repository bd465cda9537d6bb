#!/usr/bin/env bash
# bert: cfp_test/bert/bert_test.sh --num_layer 4 --batch_size 64 --mode analysis|profile|search
exec "$(dirname "$0")/../run_mode.sh" bert "$@"
