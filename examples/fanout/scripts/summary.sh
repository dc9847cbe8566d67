#!/usr/bin/env bash
# summary / done: append a line to the run's summary file.
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ -s "$QLPG_RUN_DIR/report.txt" ] || { echo "summary: report missing" >&2; exit 1; }
echo "$STEP ok $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$QLPG_RUN_DIR/summary.log"
log "summary recorded"
