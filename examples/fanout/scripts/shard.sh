#!/usr/bin/env bash
# shard-N: sum of squares over the shard's range (bash arithmetic), step key gives N.
set -euo pipefail
source "$(dirname "$0")/common.sh"
[[ "$STEP" =~ ^shard-([0-9]+)$ ]] || { echo "step key '$STEP' is not shard-N" >&2; exit 2; }
n="${BASH_REMATCH[1]}"
read -r lo hi < "$QLPG_RUN_DIR/inputs/shard-$n.range"
sum=0
for ((x = lo; x <= hi; x++)); do sum=$(( sum + x * x )); done
echo "$n $lo $hi $sum" | publish_file "$QLPG_RUN_DIR/shards/shard-$n.out"
log "shard $n: sum of squares $lo..$hi = $sum"
