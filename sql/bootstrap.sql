-- qlpg bootstrap: cluster-wide group roles and the ql3 schema.
-- Run by `qlpg migrate` with the DBA's own login BEFORE yoyo's migrations (yoyo keeps its
-- bookkeeping tables inside schema ql3, so the schema must exist first). Idempotent and safe
-- under concurrency: roles are cluster-wide and other databases may be migrating at the same time.
-- Needs CREATEROLE (or SUPERUSER) only when a role is missing.
DO $bootstrap$
DECLARE
  r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['ql3_migration', 'ql3_admin', 'ql3_package_manager',
                           'ql3_package_executor', 'ql3_runtime', 'ql3_worker_ingress'] LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
      BEGIN
        EXECUTE pg_catalog.format(
          'CREATE ROLE %I NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS', r);
      EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;  -- another session created it concurrently
      END;
    END IF;
  END LOOP;
  -- The deploying login must be able to SET ROLE ql3_migration.
  IF NOT pg_catalog.pg_has_role(current_user, 'ql3_migration', 'MEMBER') THEN
    EXECUTE pg_catalog.format('GRANT ql3_migration TO %I', current_user);
  END IF;
END
$bootstrap$;

CREATE SCHEMA IF NOT EXISTS ql3 AUTHORIZATION ql3_migration;
REVOKE ALL ON SCHEMA ql3 FROM PUBLIC;
GRANT USAGE ON SCHEMA ql3 TO ql3_admin, ql3_package_manager, ql3_package_executor,
  ql3_runtime, ql3_worker_ingress;
