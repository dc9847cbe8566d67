#!/usr/bin/env bash
# Step "restore": restore the dump into a fresh second scratch database.
set -euo pipefail
source "$(dirname "$0")/common.sh"

[ -s "$DUMP" ] || { echo "dump not found: $DUMP" >&2; exit 1; }
log "restoring into $RST_DB"
pg -d "$ADMIN_DB" -v db="$RST_DB" <<'SQL'
SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', :'db') \gexec
SELECT format('CREATE DATABASE %I', :'db') \gexec
SQL
pg_restore --no-owner --exit-on-error -d "$RST_DB" "$DUMP"
log "restored into $RST_DB"
