#!/usr/bin/env bash
# moe: analysis, profile and search in turn, each checked: cfp_test/scripts/moe_functionality_check.sh [--num_layer 2]
exec "$(dirname "$0")/functionality_check.sh" moe "$@"
