CREATE OR REPLACE FUNCTION ql3.lease_token_digest(p_token text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  -- plpgsql, not sql: a non-inlinable SQL function (it has a SET clause) is planned on every call.
  RETURN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(p_token, 'UTF8')), 'hex');
END
$fn$;
COMMENT ON FUNCTION ql3.lease_token_digest(text) IS
  'Internal (owner only). Lowercase hex SHA-256 of a lease or claim token; only this digest is ever stored (DESIGN §4, dispatch lease).';
REVOKE ALL ON FUNCTION ql3.lease_token_digest(text) FROM PUBLIC;
