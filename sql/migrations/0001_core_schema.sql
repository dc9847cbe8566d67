-- 0001 core schema of qlpg (DESIGN §4): package facts, Task Execution Revisions and the runtime
-- records of Workflow Runs. Applied by `qlpg migrate` with role ql3_migration, search_path ql3.
-- Re-runnable: yoyo marks a migration applied in a separate transaction, so every statement is
-- IF NOT EXISTS / OR REPLACE and a crash between the two transactions is harmless.
-- Every column that holds a time is milliseconds since the Unix epoch (bigint, *_ms), taken from
-- the database clock (clock_timestamp()), never from a client.

SET LOCAL lock_timeout = '30s';

ALTER DEFAULT PRIVILEGES FOR ROLE ql3_migration REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
ALTER DEFAULT PRIVILEGES FOR ROLE ql3_migration IN SCHEMA ql3 REVOKE ALL ON TABLES FROM PUBLIC;
ALTER DEFAULT PRIVILEGES FOR ROLE ql3_migration IN SCHEMA ql3 REVOKE ALL ON SEQUENCES FROM PUBLIC;

-- Immutability guard shared by every append-only table: refuses UPDATE, DELETE and TRUNCATE even
-- for the owner (grants already forbid them for every service role).
CREATE OR REPLACE FUNCTION ql3.reject_mutation() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  RAISE EXCEPTION USING ERRCODE = 'QL201',
    MESSAGE = pg_catalog.format('ql3.%s is append-only: %s is refused (immutable record)',
                                TG_TABLE_NAME, TG_OP);
END
$fn$;
COMMENT ON FUNCTION ql3.reject_mutation() IS
  'Trigger function (internal, owner only). Raises QL201 for UPDATE, DELETE or TRUNCATE on an append-only ql3 table. Source: DESIGN §4 (immutable tables).';
REVOKE ALL ON FUNCTION ql3.reject_mutation() FROM PUBLIC;

CREATE TABLE IF NOT EXISTS ql3.schema_capabilities (
  capability      text PRIMARY KEY,
  version         integer NOT NULL CHECK (version > 0),
  installed_at_ms bigint NOT NULL
);

-- ---------------------------------------------------------------- package facts (ADR-0223 §1-2)
CREATE TABLE IF NOT EXISTS ql3.package_materialized_revisions (
  project_id      text NOT NULL,
  package_id      text NOT NULL,
  generation      integer NOT NULL CHECK (generation BETWEEN 1 AND 2147483647),
  revision_digest text NOT NULL UNIQUE CHECK (revision_digest ~ '^[0-9a-f]{64}$'),
  installation_id text NOT NULL,
  lock_digest     text NOT NULL CHECK (lock_digest ~ '^[0-9a-f]{64}$'),
  publisher_id    text NOT NULL,
  package_version text NOT NULL,
  document        jsonb NOT NULL,
  created_at_ms   bigint NOT NULL,
  PRIMARY KEY (project_id, package_id, generation)
);

CREATE TABLE IF NOT EXISTS ql3.package_revision_tasks (
  project_id         text NOT NULL,
  package_id         text NOT NULL,
  generation         integer NOT NULL,
  task_key           text NOT NULL,
  source_digest      text NOT NULL CHECK (source_digest ~ '^[0-9a-f]{64}$'),
  enabled            boolean NOT NULL,
  executor_type      text NOT NULL CHECK (executor_type IN ('local_process', 'remote_worker')),
  execution_template jsonb NOT NULL,
  PRIMARY KEY (project_id, package_id, generation, task_key),
  FOREIGN KEY (project_id, package_id, generation)
    REFERENCES ql3.package_materialized_revisions (project_id, package_id, generation)
);

CREATE TABLE IF NOT EXISTS ql3.package_revision_workflows (
  project_id      text NOT NULL,
  package_id      text NOT NULL,
  generation      integer NOT NULL,
  workflow_key    text NOT NULL,
  semantic_digest text NOT NULL CHECK (semantic_digest ~ '^[0-9a-f]{64}$'),
  enabled         boolean NOT NULL,
  definition      jsonb NOT NULL,
  PRIMARY KEY (project_id, package_id, generation, workflow_key),
  FOREIGN KEY (project_id, package_id, generation)
    REFERENCES ql3.package_materialized_revisions (project_id, package_id, generation)
);

CREATE TABLE IF NOT EXISTS ql3.automation_publications (
  publication_id     text PRIMARY KEY,
  publication_digest text NOT NULL UNIQUE CHECK (publication_digest ~ '^[0-9a-f]{64}$'),
  project_id         text NOT NULL,
  package_id         text NOT NULL,
  generation         integer NOT NULL,
  revision_digest    text NOT NULL,
  status             text NOT NULL CHECK (status IN ('active', 'withdrawn')),
  published_at_ms    bigint NOT NULL,
  withdrawn_at_ms    bigint,
  withdrawn_reason   text,
  CHECK ((status = 'withdrawn') = (withdrawn_at_ms IS NOT NULL)),
  FOREIGN KEY (project_id, package_id, generation)
    REFERENCES ql3.package_materialized_revisions (project_id, package_id, generation)
);

CREATE TABLE IF NOT EXISTS ql3.automation_publication_heads (
  project_id     text NOT NULL,
  package_id     text NOT NULL,
  publication_id text NOT NULL REFERENCES ql3.automation_publications (publication_id),
  updated_at_ms  bigint NOT NULL,
  PRIMARY KEY (project_id, package_id)
);

CREATE TABLE IF NOT EXISTS ql3.package_quarantines (
  project_id        text NOT NULL,
  package_id        text NOT NULL,
  quarantined_at_ms bigint NOT NULL,
  reason            text NOT NULL,
  actor             text NOT NULL,
  PRIMARY KEY (project_id, package_id)
);

CREATE TABLE IF NOT EXISTS ql3.publisher_revocations (
  publisher_id  text PRIMARY KEY,
  revoked_at_ms bigint NOT NULL,
  reason        text NOT NULL,
  actor         text NOT NULL
);

CREATE TABLE IF NOT EXISTS ql3.task_reconciliation_receipts (
  receipt_digest  text PRIMARY KEY CHECK (receipt_digest ~ '^[0-9a-f]{64}$'),
  project_id      text NOT NULL,
  package_id      text NOT NULL,
  generation      integer NOT NULL,
  installation_id text NOT NULL,
  lock_digest     text NOT NULL,
  revision_digest text NOT NULL,
  created_at_ms   bigint NOT NULL,
  UNIQUE (project_id, package_id, generation),
  FOREIGN KEY (project_id, package_id, generation)
    REFERENCES ql3.package_materialized_revisions (project_id, package_id, generation)
);

CREATE TABLE IF NOT EXISTS ql3.task_reconciliation_items (
  receipt_digest    text NOT NULL REFERENCES ql3.task_reconciliation_receipts (receipt_digest),
  task_key          text NOT NULL,
  runtime_task_id   text NOT NULL,
  task_revision     text NOT NULL CHECK (task_revision ~ '^qltd:v1:[0-9]{1,10}:[0-9a-f]{64}$'),
  definition_digest text NOT NULL CHECK (definition_digest ~ '^[0-9a-f]{64}$'),
  source_digest     text NOT NULL,
  executor_type     text NOT NULL CHECK (executor_type IN ('local_process', 'remote_worker')),
  execution_digest  text NOT NULL CHECK (execution_digest ~ '^[0-9a-f]{64}$'),
  PRIMARY KEY (receipt_digest, task_key)
);

-- ADR-0023: one immutable row per (project, task, revision); no FK to any mutable task row.
-- Nothing secret, no environment values, no Run/Attempt identity, lease, token, PID or log handle.
CREATE TABLE IF NOT EXISTS ql3.task_execution_revisions (
  project_id         text NOT NULL,
  task_id            text NOT NULL,
  task_revision      text NOT NULL,
  executor_type      text NOT NULL CHECK (executor_type IN ('local_process', 'remote_worker')),
  execution_template jsonb NOT NULL,
  context_ref        text,
  content_digest     text NOT NULL CHECK (content_digest ~ '^[0-9a-f]{64}$'),
  created_at_ms      bigint NOT NULL,
  PRIMARY KEY (project_id, task_id, task_revision)
);
-- For a future reference-proven retention scan (ADR-0023 §4).
CREATE INDEX IF NOT EXISTS task_execution_revisions_retention_idx
  ON ql3.task_execution_revisions (project_id, created_at_ms);

-- ---------------------------------------------------------------- runtime records
CREATE TABLE IF NOT EXISTS ql3.runs (
  id                     text PRIMARY KEY,
  project_id             text NOT NULL,
  package_id             text NOT NULL,
  task_id                text NOT NULL,          -- the Workflow id (workflow key)
  task_revision          text NOT NULL,          -- the publication digest
  publication_id         text NOT NULL,
  generation             integer NOT NULL,
  publisher_id           text NOT NULL,
  plan_digest            text NOT NULL UNIQUE,
  status                 text NOT NULL
                         CHECK (status IN ('running', 'succeeded', 'failed', 'timed_out', 'cancelled')),
  version                bigint NOT NULL CHECK (version >= 1),
  event_sequence         bigint NOT NULL CHECK (event_sequence >= 1),
  last_attempt           integer NOT NULL DEFAULT 0 CHECK (last_attempt BETWEEN 0 AND 8192),
  steps_total            integer NOT NULL,
  cancel_requested_at_ms bigint,
  cancel_reason          text CHECK (cancel_reason IN ('user', 'policy', 'shutdown')),
  cancel_actor           text,
  created_at_ms          bigint NOT NULL,
  observed_at_ms         bigint NOT NULL,        -- monotonic database observation time of this Run
  ended_at_ms            bigint,
  CHECK ((status = 'running') = (ended_at_ms IS NULL)),
  CHECK ((cancel_requested_at_ms IS NULL) = (cancel_reason IS NULL))
);
CREATE INDEX IF NOT EXISTS runs_cancel_pending_idx ON ql3.runs (id)
  WHERE status = 'running' AND cancel_requested_at_ms IS NOT NULL;

CREATE TABLE IF NOT EXISTS ql3.step_runs (
  id             text PRIMARY KEY,
  run_id         text NOT NULL REFERENCES ql3.runs (id),
  step_key       text NOT NULL,
  task_key       text NOT NULL,
  status         text NOT NULL CHECK (status IN ('pending', 'ready', 'running', 'succeeded', 'failed',
                                                 'skipped', 'cancelled', 'timed_out', 'lost')),
  version        integer NOT NULL CHECK (version >= 1),
  attempt_count  integer NOT NULL DEFAULT 0 CHECK (attempt_count BETWEEN 0 AND 64),
  digest         text NOT NULL,
  needs          text[] NOT NULL,
  unmet_needs    integer NOT NULL CHECK (unmet_needs >= 0),
  epoch_admitted boolean NOT NULL DEFAULT false,  -- the current ready epoch has an admission winner
  current_attempt_id text,
  ready_at_ms    bigint,
  started_at_ms  bigint,
  ended_at_ms    bigint,
  created_at_ms  bigint NOT NULL,
  updated_at_ms  bigint NOT NULL,
  UNIQUE (run_id, step_key)
);
-- Attempt candidates (ADR-0227 §3): only ready epochs without a winner are indexed, so a
-- candidate page costs the same however much history the table holds.
CREATE INDEX IF NOT EXISTS step_runs_candidates_idx ON ql3.step_runs (run_id, id)
  WHERE status = 'ready' AND NOT epoch_admitted;
CREATE INDEX IF NOT EXISTS step_runs_run_idx ON ql3.step_runs (run_id, status);

CREATE TABLE IF NOT EXISTS ql3.step_run_mutations (
  step_run_id    text NOT NULL REFERENCES ql3.step_runs (id),
  version        integer NOT NULL,
  run_id         text NOT NULL,
  from_status    text,
  to_status      text NOT NULL,
  run_sequence   bigint NOT NULL,
  digest         text NOT NULL,
  attempt_id     text,
  reason         text NOT NULL,
  at_ms          bigint NOT NULL,
  PRIMARY KEY (step_run_id, version)
);

CREATE TABLE IF NOT EXISTS ql3.run_events (
  run_id      text NOT NULL REFERENCES ql3.runs (id),
  sequence    bigint NOT NULL CHECK (sequence >= 1),
  type        text NOT NULL,
  step_run_id text,
  attempt_id  text,
  payload     jsonb NOT NULL DEFAULT '{}'::jsonb,
  at_ms       bigint NOT NULL,
  PRIMARY KEY (run_id, sequence)
);
CREATE INDEX IF NOT EXISTS run_events_attempt_idx ON ql3.run_events (attempt_id, type)
  WHERE attempt_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS ql3.workflow_admissions (
  run_id          text PRIMARY KEY REFERENCES ql3.runs (id),
  plan_digest     text NOT NULL UNIQUE,
  plan            jsonb NOT NULL,
  receipt         jsonb NOT NULL,
  receipt_digest  text NOT NULL,
  publication_id  text NOT NULL,
  admitted_at_ms  bigint NOT NULL
);

CREATE TABLE IF NOT EXISTS ql3.workflow_admission_steps (
  run_id          text NOT NULL REFERENCES ql3.workflow_admissions (run_id),
  step_run_id     text NOT NULL,
  step_key        text NOT NULL,
  task_key        text NOT NULL,
  task_reference  text NOT NULL,
  source_digest   text NOT NULL,
  needs           text[] NOT NULL,
  initial_status  text NOT NULL CHECK (initial_status IN ('pending', 'ready')),
  PRIMARY KEY (run_id, step_run_id),
  UNIQUE (run_id, step_key)
);

CREATE TABLE IF NOT EXISTS ql3.task_attempt_admissions (
  run_id            text NOT NULL REFERENCES ql3.runs (id),
  step_run_id       text NOT NULL REFERENCES ql3.step_runs (id),
  step_run_version  integer NOT NULL,
  attempt_id        text NOT NULL UNIQUE,
  attempt           integer NOT NULL CHECK (attempt BETWEEN 1 AND 8192),
  event_id          text NOT NULL UNIQUE,
  runtime_task_id   text NOT NULL,
  task_revision     text NOT NULL,
  executor_type     text NOT NULL,
  execution_digest  text NOT NULL,
  receipt           jsonb NOT NULL,
  receipt_digest    text NOT NULL,
  admitted_at_ms    bigint NOT NULL,
  PRIMARY KEY (run_id, step_run_id, step_run_version),
  UNIQUE (run_id, attempt)
);

CREATE TABLE IF NOT EXISTS ql3.run_attempts (
  id                 text PRIMARY KEY,
  run_id             text NOT NULL REFERENCES ql3.runs (id),
  step_run_id        text NOT NULL REFERENCES ql3.step_runs (id),
  step_run_version   integer NOT NULL,
  attempt            integer NOT NULL CHECK (attempt BETWEEN 1 AND 8192),
  status             text NOT NULL CHECK (status IN ('claimed', 'starting', 'running', 'succeeded',
                                                     'failed', 'cancelled', 'timed_out', 'lost')),
  executor_type      text NOT NULL CHECK (executor_type IN ('local_process', 'remote_worker')),
  project_id         text NOT NULL,
  runtime_task_id    text NOT NULL,
  task_revision      text NOT NULL,
  execution_digest   text NOT NULL,
  timeout_ms         integer NOT NULL,
  deadline_at_ms     bigint,
  lease_active       boolean NOT NULL DEFAULT false,
  lease_expires_at_ms bigint,
  lease_count        integer NOT NULL DEFAULT 0,
  worker_id          text,
  stop_reason        text,
  created_at_ms      bigint NOT NULL,
  started_at_ms      bigint,
  running_at_ms      bigint,
  ended_at_ms        bigint,
  UNIQUE (run_id, attempt),
  FOREIGN KEY (run_id, step_run_id, step_run_version)
    REFERENCES ql3.task_attempt_admissions (run_id, step_run_id, step_run_version)
);
-- Lease acquisition scans only unleased claimed attempts.
CREATE INDEX IF NOT EXISTS run_attempts_dispatch_idx ON ql3.run_attempts (executor_type, created_at_ms, id)
  WHERE status = 'claimed' AND NOT lease_active;
-- Recovery source: attempts holding a lease (expiry is compared at read time).
CREATE INDEX IF NOT EXISTS run_attempts_leased_idx ON ql3.run_attempts (lease_expires_at_ms, id)
  WHERE lease_active;
CREATE INDEX IF NOT EXISTS run_attempts_step_idx ON ql3.run_attempts (step_run_id, attempt);

CREATE TABLE IF NOT EXISTS ql3.run_dispatch_leases (
  attempt_id    text NOT NULL REFERENCES ql3.run_attempts (id),
  lease_no      integer NOT NULL CHECK (lease_no >= 1),
  token_sha256  text NOT NULL CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
  worker_id     text NOT NULL,
  holder_login  text NOT NULL,                  -- session_user that acquired the lease
  status        text NOT NULL CHECK (status IN ('leased', 'released', 'completed')),
  leased_at_ms  bigint NOT NULL,
  expires_at_ms bigint NOT NULL,
  ended_at_ms   bigint,
  end_reason    text,
  PRIMARY KEY (attempt_id, lease_no)
);
CREATE UNIQUE INDEX IF NOT EXISTS run_dispatch_leases_one_live_idx
  ON ql3.run_dispatch_leases (attempt_id) WHERE status = 'leased';

CREATE TABLE IF NOT EXISTS ql3.run_attempt_completions (
  attempt_id     text PRIMARY KEY REFERENCES ql3.run_attempts (id),
  run_id         text NOT NULL,
  outcome        text NOT NULL,
  exit_code      integer,
  detail         jsonb NOT NULL DEFAULT '{}'::jsonb,  -- worker evidence: log paths, signal, duration
  receipt        jsonb NOT NULL,
  receipt_digest text NOT NULL,
  completed_at_ms bigint NOT NULL
);

CREATE TABLE IF NOT EXISTS ql3.run_recovery_controls (
  attempt_id          text PRIMARY KEY REFERENCES ql3.run_attempts (id),
  run_id              text NOT NULL,
  status              text NOT NULL CHECK (status IN ('available', 'claimed', 'resolved', 'retry', 'manual')),
  claim_token_sha256  text,
  claimed_by          text,
  claim_expires_at_ms bigint,
  next_claim_at_ms    bigint NOT NULL,
  failure_count       integer NOT NULL DEFAULT 0,
  last_evidence       text CHECK (last_evidence IN ('not_running', 'unknown')),
  evidence_source     text,
  resolution          text,
  created_at_ms       bigint NOT NULL,
  updated_at_ms       bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS run_recovery_controls_claimable_idx
  ON ql3.run_recovery_controls (next_claim_at_ms, attempt_id)
  WHERE status IN ('available', 'retry', 'claimed');

-- ---------------------------------------------------------------- immutability triggers
DO $imm$
DECLARE
  t text;
BEGIN
  FOREACH t IN ARRAY ARRAY['package_materialized_revisions', 'package_revision_tasks',
      'package_revision_workflows', 'package_quarantines', 'publisher_revocations',
      'task_reconciliation_receipts', 'task_reconciliation_items', 'task_execution_revisions',
      'step_run_mutations', 'run_events', 'workflow_admissions', 'workflow_admission_steps',
      'task_attempt_admissions', 'run_attempt_completions'] LOOP
    EXECUTE pg_catalog.format('DROP TRIGGER IF EXISTS %I ON ql3.%I', t || '_immutable', t);
    EXECUTE pg_catalog.format(
      'CREATE TRIGGER %I BEFORE UPDATE OR DELETE ON ql3.%I FOR EACH ROW EXECUTE FUNCTION ql3.reject_mutation()',
      t || '_immutable', t);
    EXECUTE pg_catalog.format('DROP TRIGGER IF EXISTS %I ON ql3.%I', t || '_no_truncate', t);
    EXECUTE pg_catalog.format(
      'CREATE TRIGGER %I BEFORE TRUNCATE ON ql3.%I FOR EACH STATEMENT EXECUTE FUNCTION ql3.reject_mutation()',
      t || '_no_truncate', t);
    EXECUTE pg_catalog.format('COMMENT ON TABLE ql3.%I IS %L', t,
      'Append-only (immutable): UPDATE, DELETE and TRUNCATE are refused by trigger with QL201.');
  END LOOP;
END
$imm$;

INSERT INTO ql3.schema_capabilities (capability, version, installed_at_ms)
VALUES ('core', 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)
ON CONFLICT (capability) DO NOTHING;

-- Which set of sql/functions files is deployed (sha256 over their sorted names and bytes), so a
-- second `qlpg migrate` with unchanged files changes nothing.
CREATE TABLE IF NOT EXISTS ql3.function_deployments (
  digest        text PRIMARY KEY,
  file_count    integer NOT NULL,
  applied_at_ms bigint NOT NULL
);
