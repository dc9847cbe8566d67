#!/usr/bin/env bash
# prepare: write one input range per shard into $QLPG_RUN_DIR/inputs/.
set -euo pipefail
source "$(dirname "$0")/common.sh"
mkdir -p "$QLPG_RUN_DIR/inputs" "$QLPG_RUN_DIR/shards"
for ((i = 1; i <= SHARDS; i++)); do
    lo=$(( (i - 1) * PER_SHARD + 1 )); hi=$(( i * PER_SHARD ))
    echo "$lo $hi" | publish_file "$QLPG_RUN_DIR/inputs/shard-$i.range"
done
echo "$SHARDS $PER_SHARD" | publish_file "$QLPG_RUN_DIR/inputs/plan"
log "prepared $SHARDS shards of $PER_SHARD numbers"
