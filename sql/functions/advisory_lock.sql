CREATE OR REPLACE FUNCTION ql3.advisory_lock(p_kind text, p_id text, p_shared boolean DEFAULT false) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF p_shared THEN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtextextended('ql3-' || p_kind || ':' || p_id, 0));
  ELSE
    PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('ql3-' || p_kind || ':' || p_id, 0));
  END IF;
END
$fn$;
COMMENT ON FUNCTION ql3.advisory_lock(text, text, boolean) IS
  'Internal (owner only). Takes the transaction-level advisory lock ql3-<kind>:<id> (shared or exclusive; never a session lock, so PgBouncer transaction pooling works). Global order: package/publisher boundary -> run -> step run -> attempt -> recovery control. Source: DESIGN §7.';
REVOKE ALL ON FUNCTION ql3.advisory_lock(text, text, boolean) FROM PUBLIC;
