#!/usr/bin/env bash
# audit-inputs: input ranges are contiguous and non-overlapping.
set -euo pipefail
source "$(dirname "$0")/common.sh"
next=1
for ((i = 1; i <= SHARDS; i++)); do
    read -r lo hi < "$QLPG_RUN_DIR/inputs/shard-$i.range"
    [ "$lo" -eq "$next" ] && [ "$hi" -ge "$lo" ] || { echo "audit-inputs: bad range for shard $i: $lo..$hi" >&2; exit 1; }
    next=$(( hi + 1 ))
done
log "inputs contiguous: 1..$(( next - 1 ))"
