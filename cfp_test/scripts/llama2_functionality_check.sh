#!/usr/bin/env bash
# llama2: analysis, profile and search in turn, each checked: cfp_test/scripts/llama2_functionality_check.sh [--num_layer 2]
exec "$(dirname "$0")/functionality_check.sh" llama2 "$@"
