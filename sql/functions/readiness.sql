CREATE OR REPLACE FUNCTION ql3.readiness()
RETURNS TABLE ("check" text, ok boolean, detail text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  v_roles text[] := ARRAY['ql3_migration', 'ql3_admin', 'ql3_package_manager', 'ql3_package_executor',
                          'ql3_runtime', 'ql3_worker_ingress'];
  v_text text;
  v_n bigint;
BEGIN
  PERFORM ql3.require_role('readiness', 'ql3_migration', 'ql3_admin', 'ql3_package_manager',
                           'ql3_package_executor', 'ql3_runtime', 'ql3_worker_ingress');
  SELECT pg_catalog.string_agg(c.capability || '=' || c.version, ', ' ORDER BY c.capability) INTO v_text
    FROM ql3.schema_capabilities c;
  RETURN QUERY SELECT 'schema_capabilities'::text, v_text IS NOT NULL AND v_text LIKE '%core=%', COALESCE(v_text, 'none');

  SELECT pg_catalog.count(*) INTO v_n FROM ql3._yoyo_migration;
  RETURN QUERY SELECT 'migrations_applied'::text, v_n > 0, v_n || ' yoyo migrations applied';

  SELECT pg_catalog.string_agg(x, ', ') INTO v_text FROM pg_catalog.unnest(v_roles) x
   WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = x);
  RETURN QUERY SELECT 'roles_present'::text, v_text IS NULL, COALESCE('missing: ' || v_text, 'six group roles present');

  SELECT pg_catalog.string_agg(r.rolname, ', ') INTO v_text FROM pg_catalog.pg_roles r
   WHERE r.rolname = ANY (v_roles)
     AND (r.rolsuper OR r.rolcreatedb OR r.rolcreaterole OR r.rolreplication OR r.rolbypassrls OR r.rolcanlogin);
  RETURN QUERY SELECT 'roles_least_privilege'::text, v_text IS NULL,
    COALESCE('roles with LOGIN/SUPERUSER/CREATEDB/CREATEROLE/REPLICATION/BYPASSRLS: ' || v_text,
             'group roles are NOLOGIN without SUPERUSER, CREATEDB, CREATEROLE, REPLICATION, BYPASSRLS');

  -- Every function a non-owner may execute is SECURITY DEFINER, owned by ql3_migration, pins search_path
  -- and has a comment.
  SELECT pg_catalog.string_agg(p.oid::regprocedure::text, ', ') INTO v_text
    FROM pg_catalog.pg_proc p
   WHERE p.pronamespace = 'ql3'::regnamespace
     AND EXISTS (SELECT 1 FROM pg_catalog.aclexplode(COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) x
                  WHERE x.privilege_type = 'EXECUTE' AND x.grantee <> p.proowner)
     AND (NOT p.prosecdef OR p.proowner <> 'ql3_migration'::regrole
          OR NOT COALESCE(p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'], false)
          OR pg_catalog.obj_description(p.oid, 'pg_proc') IS NULL);
  RETURN QUERY SELECT 'function_security'::text, v_text IS NULL,
    COALESCE('non-conforming: ' || v_text, 'every granted ql3 function is SECURITY DEFINER, owned by ql3_migration, pins search_path and has a comment');

  SELECT pg_catalog.string_agg(c.relname, ', ') INTO v_text
    FROM pg_catalog.pg_class c
   WHERE c.relnamespace = 'ql3'::regnamespace AND c.relkind = 'r'
     AND c.relname = ANY (ARRAY['package_materialized_revisions', 'package_revision_tasks', 'package_revision_workflows',
           'package_quarantines', 'publisher_revocations', 'task_reconciliation_receipts', 'task_reconciliation_items',
           'task_execution_revisions', 'step_run_mutations', 'run_events', 'workflow_admissions',
           'workflow_admission_steps', 'task_attempt_admissions', 'run_attempt_completions'])
     AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND t.tgenabled IN ('O', 'A')
                      AND t.tgname = c.relname || '_immutable');
  RETURN QUERY SELECT 'immutability_triggers'::text, v_text IS NULL,
    COALESCE('tables without an enabled immutability trigger: ' || v_text, 'append-only tables refuse UPDATE/DELETE/TRUNCATE');

  SELECT pg_catalog.string_agg(DISTINCT c.relname || ':' || x.privilege_type || ':' ||
           CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END, ', ') INTO v_text
    FROM pg_catalog.pg_class c, LATERAL pg_catalog.aclexplode(c.relacl) x
   WHERE c.relnamespace = 'ql3'::regnamespace AND c.relkind IN ('r', 'S', 'v', 'm', 'p')
     AND x.grantee <> c.relowner;
  RETURN QUERY SELECT 'no_table_privileges'::text, v_text IS NULL,
    COALESCE('table/sequence privileges held by non-owners: ' || v_text, 'no role but the owner has any table or sequence privilege');

  RETURN QUERY SELECT 'synchronous_commit'::text,
    pg_catalog.current_setting('synchronous_commit') IN ('on', 'remote_apply'),
    'synchronous_commit=' || pg_catalog.current_setting('synchronous_commit') ||
    ' synchronous_standby_names=' || COALESCE(NULLIF(pg_catalog.current_setting('synchronous_standby_names'), ''), '''''') ||
    ' (qlpg needs on or remote_apply for its authority transactions: remote_write, local and off can lose acknowledged receipts on failover; see docs/ha.md)';
  RETURN QUERY SELECT 'server_encoding'::text, pg_catalog.current_setting('server_encoding') = 'UTF8',
    'server_encoding=' || pg_catalog.current_setting('server_encoding');
  RETURN QUERY SELECT 'server_version'::text, pg_catalog.current_setting('server_version_num')::integer >= 150000,
    'server_version=' || pg_catalog.current_setting('server_version');
END
$fn$;
COMMENT ON FUNCTION ql3.readiness() IS
  'Every role (ql3_migration, ql3_admin, ql3_package_manager, ql3_package_executor, ql3_runtime, ql3_worker_ingress). Read-only deployment self-check: rows (check, ok, detail) for schema capabilities, yoyo migrations applied, the six group roles and their attributes, function security properties (SECURITY DEFINER, owner, pinned search_path, comment), immutability triggers, absence of table privileges, synchronous_commit, server encoding and version (>= 15). qlpg doctor adds the grants golden-file comparison. Errors: QL601 when the caller is in none of the six roles.';
REVOKE ALL ON FUNCTION ql3.readiness() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql3.readiness() TO ql3_migration, ql3_admin, ql3_package_manager, ql3_package_executor,
  ql3_runtime, ql3_worker_ingress;
