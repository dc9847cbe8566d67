CREATE OR REPLACE FUNCTION ql3.now_ms() RETURNS bigint
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  -- plpgsql, not sql: a non-inlinable SQL function (it has a SET clause) is planned on every call.
  RETURN (EXTRACT(epoch FROM pg_catalog.clock_timestamp()) * 1000)::bigint;
END
$fn$;
COMMENT ON FUNCTION ql3.now_ms() IS
  'Internal (owner only). Database observation time: clock_timestamp() in milliseconds since the Unix epoch (bigint). Source: DESIGN §7 (never the client clock).';
REVOKE ALL ON FUNCTION ql3.now_ms() FROM PUBLIC;
