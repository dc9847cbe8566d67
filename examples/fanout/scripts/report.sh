#!/usr/bin/env bash
# report: human-readable report of the merged result.
set -euo pipefail
source "$(dirname "$0")/common.sh"
read -r N total < "$QLPG_RUN_DIR/merged"
{
    echo "fanout report"
    echo "N=$N sum_of_squares=$total"
    for f in "$QLPG_RUN_DIR"/shards/shard-*.out; do
        read -r n lo hi sum < "$f"; echo "shard $n [$lo..$hi] $sum"
    done
} | publish_file "$QLPG_RUN_DIR/report.txt"
cat "$QLPG_RUN_DIR/report.txt"
