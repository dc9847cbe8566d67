CREATE OR REPLACE FUNCTION ql3.require_role(p_function text, VARIADIC p_roles text[]) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  r text;
BEGIN
  FOREACH r IN ARRAY p_roles LOOP
    IF pg_catalog.pg_has_role(session_user, r, 'MEMBER') THEN
      RETURN;
    END IF;
  END LOOP;
  RAISE EXCEPTION USING ERRCODE = 'QL601',
    MESSAGE = pg_catalog.format('ql3.%s: session user %I is not a member of %s', p_function,
                                session_user, pg_catalog.array_to_string(p_roles, ' or ')),
    HINT = 'connect as a login that is a member of exactly the role this function is granted to';
END
$fn$;
COMMENT ON FUNCTION ql3.require_role(text, text[]) IS
  'Internal (owner only). Caller-role check of every SECURITY DEFINER function: returns when session_user is a member (pg_has_role MEMBER) of one of p_roles, else raises QL601 naming the function and the roles. Source: DESIGN §3.';
REVOKE ALL ON FUNCTION ql3.require_role(text, text[]) FROM PUBLIC;
