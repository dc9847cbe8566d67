#!/usr/bin/env bash
# Step "cleanup": drop both scratch databases (idempotent).
set -euo pipefail
source "$(dirname "$0")/common.sh"

for db in "$RST_DB" "$SRC_DB"; do
    pg -d "$ADMIN_DB" -v db="$db" <<'SQL'
SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', :'db') \gexec
SQL
    log "dropped $db"
done
