#!/usr/bin/env bash
# Step "create": (re)create the empty source scratch database.
set -euo pipefail
source "$(dirname "$0")/common.sh"

log "creating $SRC_DB (via $ADMIN_DB)"
# DROP first so a retried attempt starts clean.
pg -d "$ADMIN_DB" -v db="$SRC_DB" <<'SQL'
SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', :'db') \gexec
SELECT format('CREATE DATABASE %I', :'db') \gexec
SQL
log "created $SRC_DB"
