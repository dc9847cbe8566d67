#!/usr/bin/env bash
# audit-env: the worker passes the QLPG_* variables and nothing secret-looking.
set -euo pipefail
source "$(dirname "$0")/common.sh"
for v in QLPG_RUN_ID QLPG_RUN_DIR QLPG_STEP_KEY; do
    [ -n "${!v:-}" ] || { echo "audit-env: $v not set" >&2; exit 1; }
done
leaks=$(env | cut -d= -f1 | grep -E '^(PGPASSWORD|AWS_|GITHUB_TOKEN|DATABASE_URL)' || true)
[ -z "$leaks" ] || { echo "audit-env: unexpected variables in task env: $leaks" >&2; exit 1; }
env | cut -d= -f1 | sort | publish_file "$QLPG_RUN_DIR/env-names.txt"
log "environment ok ($(wc -l < "$QLPG_RUN_DIR/env-names.txt") variables)"
