#!/usr/bin/env bash
# lint: every package script parses (bash -n).
set -euo pipefail
source "$(dirname "$0")/common.sh"
n=0
for f in "$(dirname "$0")"/*.sh; do bash -n "$f"; n=$((n + 1)); done
log "lint ok: $n scripts"
