CREATE OR REPLACE FUNCTION ql3.lease_token_digest(p_token text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(p_token, 'UTF8')), 'hex')
$fn$;
COMMENT ON FUNCTION ql3.lease_token_digest(text) IS
  'Internal (owner only). Lowercase hex SHA-256 of a lease or claim token; only this digest is ever stored (DESIGN §4, dispatch lease).';
REVOKE ALL ON FUNCTION ql3.lease_token_digest(text) FROM PUBLIC;
