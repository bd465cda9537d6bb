#!/usr/bin/env bash
# bert: analysis, profile and search in turn, each checked: cfp_test/scripts/bert_functionality_check.sh [--num_layer 2]
exec "$(dirname "$0")/functionality_check.sh" bert "$@"
