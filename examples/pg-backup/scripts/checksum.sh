#!/usr/bin/env bash
# Step "checksum": sha256 of the dump into $QLPG_RUN_DIR/dump.pgc.sha256.
set -euo pipefail
source "$(dirname "$0")/common.sh"

[ -s "$DUMP" ] || { echo "dump not found: $DUMP" >&2; exit 1; }
cd "$QLPG_RUN_DIR"
sha256sum dump.pgc > dump.pgc.sha256.partial
mv -f dump.pgc.sha256.partial dump.pgc.sha256
log "checksum: $(cat dump.pgc.sha256)"
