#!/usr/bin/env bash
# archive: tar the shard outputs and report, then list the archive back.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$QLPG_RUN_DIR"
tar -czf results.tar.gz.partial shards report.txt merged
mv -f results.tar.gz.partial results.tar.gz
count=$(tar -tzf results.tar.gz | grep -c 'shard-.*\.out$')
[ "$count" -eq "$SHARDS" ] || { echo "archive: expected $SHARDS shard files, got $count" >&2; exit 1; }
log "archived $(stat -c %s results.tar.gz) bytes"
