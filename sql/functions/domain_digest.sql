-- ql3.domain_digest(text, text) -> text
-- Domain-separated SHA-256 over canonical JSON (DESIGN §6). Internal helper: not SECURITY DEFINER,
-- granted to no role.

CREATE OR REPLACE FUNCTION ql3.domain_digest(p_domain text, p_canonical text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF p_domain !~ '^[a-z0-9][a-z0-9._/-]*@v[0-9]+$' OR pg_catalog.octet_length(p_domain) > 128 THEN
        RAISE EXCEPTION USING ERRCODE = 'QL001',
            MESSAGE = pg_catalog.format('domain_digest: domain %s must match ^[a-z0-9][a-z0-9._/-]*@v[0-9]+$ (at most 128 bytes)',
                                        pg_catalog.left(pg_catalog.to_json(p_domain)::text, 80));
    END IF;
    RETURN pg_catalog.encode(
        pg_catalog.sha256(pg_catalog.convert_to(p_domain, 'UTF8')
                          || '\x00'::bytea
                          || pg_catalog.convert_to(p_canonical, 'UTF8')),
        'hex');
END;
$fn$;

COMMENT ON FUNCTION ql3.domain_digest(text, text) IS
'Internal helper. Takes a versioned digest domain (e.g. ''qinglong/task-execution-revision@v1''; '
'must match ^[a-z0-9][a-z0-9._/-]*@v[0-9]+$, at most 128 bytes) and a canonical JSON text as '
'produced by ql3.canonical_json, and returns the lowercase hex (64 chars) SHA-256 of '
'UTF-8(domain) || 0x00 || UTF-8(canonical). It does not re-check that p_canonical is canonical. '
'Raises QL001 for a malformed domain. STRICT: SQL NULL in gives NULL out; callers reject NULL. '
'Not SECURITY DEFINER, granted to no role. Source: DESIGN §6.';

REVOKE ALL ON FUNCTION ql3.domain_digest(text, text) FROM PUBLIC;
