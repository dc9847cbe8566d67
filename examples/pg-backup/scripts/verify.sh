#!/usr/bin/env bash
# Step "verify": restored copy == source (row counts and content fingerprints),
# the checksum file matches the dump, and the compressed archive is intact.
set -euo pipefail
source "$(dirname "$0")/common.sh"

cd "$QLPG_RUN_DIR"
sha256sum --quiet -c dump.pgc.sha256 \
    || { echo "VERIFY FAILED: dump.pgc does not match dump.pgc.sha256" >&2; exit 1; }
log "checksum file matches dump"

comp="$(cat compressed.name)"
case "$comp" in
    *.zst) zstd -q -t "$comp" ;;
    *.gz)  gzip -t "$comp" ;;
    *) echo "VERIFY FAILED: unknown compressed file '$comp'" >&2; exit 1 ;;
esac
log "compressed archive $comp is intact"

tables=$(pg_scalar "$SRC_DB" "SELECT string_agg(tablename, ' ' ORDER BY tablename) FROM pg_tables WHERE schemaname = 'public'")
[ -n "$tables" ] || { echo "VERIFY FAILED: source has no tables" >&2; exit 1; }
fail=0
for t in $tables; do
    q="SELECT count(*) || ' ' || md5(coalesce(string_agg(x::text, E'\n' ORDER BY x::text), '')) FROM public.\"$t\" AS x"
    src=$(pg_scalar "$SRC_DB" "$q")
    rst=$(pg_scalar "$RST_DB" "$q" 2>/dev/null || echo "missing")
    if [ "$src" != "$rst" ]; then
        echo "VERIFY FAILED: table $t: source=[$src] restored=[$rst]" >&2
        fail=1
    else
        log "table $t: ${src%% *} rows, fingerprint ${src##* } (match)"
    fi
done
[ "$fail" -eq 0 ] || exit 1
log "restored database matches source"
