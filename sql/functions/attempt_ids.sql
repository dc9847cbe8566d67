CREATE OR REPLACE FUNCTION ql3.attempt_ids(p_plan_digest text, p_step_run_id text, p_step_run_version integer,
                                           OUT attempt_id text, OUT event_id text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  h text;
BEGIN
  -- plpgsql, not sql: a non-inlinable SQL function (it has a SET clause) is planned on every call.
  h := pg_catalog.left(pg_catalog.encode(pg_catalog.sha256(
            pg_catalog.convert_to('qinglong/plugin-package-workflow-task-attempt-id@v1', 'UTF8') || '\x00'::bytea ||
            pg_catalog.convert_to(p_plan_digest, 'UTF8') || '\x00'::bytea ||
            pg_catalog.convert_to(p_step_run_id, 'UTF8') || '\x00'::bytea ||
            pg_catalog.convert_to(p_step_run_version::text, 'UTF8')), 'hex'), 32);
  attempt_id := 'wta:' || h;
  event_id := 'wte:' || h;
END
$fn$;
COMMENT ON FUNCTION ql3.attempt_ids(text, text, integer) IS
  'Internal (owner only). Deterministic Attempt and RunEvent ids of a ready epoch (DESIGN §6): h = first 32 hex of SHA-256("qinglong/plugin-package-workflow-task-attempt-id@v1" 0x00 plan_digest 0x00 step_run_id 0x00 decimal step_run_version); returns (attempt_id wta:<h>, event_id wte:<h>), 36 bytes each.';
REVOKE ALL ON FUNCTION ql3.attempt_ids(text, text, integer) FROM PUBLIC;
