#!/usr/bin/env bash
# Step "dump": pg_dump -Fc the source database to $QLPG_RUN_DIR/dump.pgc.
set -euo pipefail
source "$(dirname "$0")/common.sh"

tmp="$DUMP.partial"
rm -f "$tmp"
log "dumping $SRC_DB to $DUMP"
pg_dump -Fc --no-owner -d "$SRC_DB" -f "$tmp"
# The archive must be readable and list our tables before we publish it.
pg_restore -l "$tmp" > "$QLPG_RUN_DIR/dump.toc"
for t in customers orders order_items; do
    grep -q "TABLE DATA public $t " "$QLPG_RUN_DIR/dump.toc" \
        || { echo "dump is missing data for table $t" >&2; exit 1; }
done
mv -f "$tmp" "$DUMP"
log "dump ok: $(stat -c %s "$DUMP") bytes"
