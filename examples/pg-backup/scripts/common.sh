# Sourced by every pg-backup script (which already ran `set -euo pipefail`).
# Needs QLPG_RUN_ID and QLPG_RUN_DIR from the worker; PG* from the task's env_names.
: "${QLPG_RUN_ID:?QLPG_RUN_ID must be set (provided by the qlpg worker)}"
: "${QLPG_RUN_DIR:?QLPG_RUN_DIR must be set (provided by the qlpg worker)}"
[ -d "$QLPG_RUN_DIR" ] || { echo "QLPG_RUN_DIR does not exist: $QLPG_RUN_DIR" >&2; exit 2; }

# Maintenance database used to CREATE/DROP the scratch databases.
ADMIN_DB="${PGDATABASE:-postgres}"
# Scratch database names: derived from the run id, so every step of one run
# agrees on them and concurrent runs never collide.  Only [a-z0-9_] survive.
RUN_HEX="$(printf '%s' "$QLPG_RUN_ID" | sha256sum | cut -c1-16)"
SRC_DB="qlpg_demo_${RUN_HEX}_src"
RST_DB="qlpg_demo_${RUN_HEX}_rst"
DUMP="$QLPG_RUN_DIR/dump.pgc"

# psql without ~/.psqlrc, stopping at the first error.
pg() { psql -X -q -v ON_ERROR_STOP=1 "$@"; }
# Scalar query: pg_scalar DB SQL
pg_scalar() { psql -X -q -v ON_ERROR_STOP=1 -At -d "$1" -c "$2"; }

log() { printf '[%s %s] %s\n' "${QLPG_STEP_KEY:-manual}" "$(date -u +%H:%M:%S)" "$*"; }
