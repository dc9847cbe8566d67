# Sourced by the fanout scripts (after `set -euo pipefail`).
: "${QLPG_RUN_DIR:?QLPG_RUN_DIR must be set (provided by the qlpg worker)}"
[ -d "$QLPG_RUN_DIR" ] || { echo "QLPG_RUN_DIR does not exist: $QLPG_RUN_DIR" >&2; exit 2; }
STEP="${QLPG_STEP_KEY:-manual}"
SHARDS=8
PER_SHARD=10000          # numbers per shard; total N = SHARDS * PER_SHARD
log() { printf '[%s] %s\n' "$STEP" "$*"; }
# Write-then-rename so a reader never sees a partial file.
publish_file() { local dst="$1"; cat > "$dst.partial"; mv -f "$dst.partial" "$dst"; }
