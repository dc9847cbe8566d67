#!/usr/bin/env bash
# merge (fan-in): every shard output present and consistent; total equals n(n+1)(2n+1)/6.
set -euo pipefail
source "$(dirname "$0")/common.sh"
read -r shards per < "$QLPG_RUN_DIR/inputs/plan"
total=0
for ((i = 1; i <= shards; i++)); do
    f="$QLPG_RUN_DIR/shards/shard-$i.out"
    [ -s "$f" ] || { echo "merge: missing shard output $f" >&2; exit 1; }
    read -r n lo hi sum < "$f"
    [ "$n" = "$i" ] || { echo "merge: $f belongs to shard $n" >&2; exit 1; }
    total=$(( total + sum ))
done
N=$(( shards * per ))
want=$(( N * (N + 1) * (2 * N + 1) / 6 ))
[ "$total" -eq "$want" ] || { echo "merge: total $total != expected $want" >&2; exit 1; }
echo "$N $total" | publish_file "$QLPG_RUN_DIR/merged"
log "merged $shards shards: sum of squares 1..$N = $total (verified)"
