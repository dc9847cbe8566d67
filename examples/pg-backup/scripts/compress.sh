#!/usr/bin/env bash
# Step "compress": compress the dump (zstd if available, else gzip), keep the original.
set -euo pipefail
source "$(dirname "$0")/common.sh"

[ -s "$DUMP" ] || { echo "dump not found: $DUMP" >&2; exit 1; }
if command -v zstd >/dev/null 2>&1; then
    out="$DUMP.zst"
    zstd -q -f -k -3 "$DUMP" -o "$out"
    zstd -q -t "$out"
else
    out="$DUMP.gz"
    gzip -f -k "$DUMP"
    gzip -t "$out"
fi
basename "$out" > "$QLPG_RUN_DIR/compressed.name"
log "compressed $(stat -c %s "$DUMP") -> $(stat -c %s "$out") bytes ($(basename "$out"))"
