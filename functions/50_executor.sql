-- pgfence functions/50_executor.sql — the executor registry: who runs, what each serves.
--
-- Public: executor_register, executor_heartbeat, executor_deregister (executors call them: at
--         start, on their reaper timer, at shutdown); executor_serving(module, queue) (how many
--         live executors serve a queue, for any role). The view audit_executors (every
--         registered executor with its liveness) is in 94_audit_executors.sql.
-- An executor is alive while its last heartbeat is younger than three heartbeat intervals
-- (expires_at, database clock). audit_queue_health (91) flags the queues with due work and no
-- live executor; a plan run released to executors waits while none serves plans
-- (_plan_heal / _plan_lock ask pgfence._plan_served) and executor_register revives such runs.
-- Time: now(), the database clock. Errors: functions/ERRORS.md.

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
-- How many live executors serve one queue of one module (the plans' queue is '*').
CREATE OR REPLACE FUNCTION pgfence._executor_serving(p_module text, p_queue text)
RETURNS integer
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  -- PL/pgSQL: the table (migration 0016) is looked up when called, not when this is created.
  RETURN (SELECT count(*)::integer FROM pgfence.executor x
          WHERE x.stopped_at IS NULL AND x.expires_at >= now()
            AND x.serves ? p_module
            AND (p_module = 'plan' OR x.serves -> p_module ? '*' OR x.serves -> p_module ? p_queue));
END
$$;
REVOKE ALL ON FUNCTION pgfence._executor_serving(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._executor_serving(text, text) TO pgfence_client, pgfence_executor, pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence._executor_serving(text, text) IS
  'Private: how many live executors serve queue p_queue of module p_module.
Live = registered, not stopped, last heartbeat within three intervals. Plans: any executor with the plan module. Security definer: audit_queue_health calls it as its reader, who may not read pgfence.executor. Errors: none.';

-- Does a live executor serve plans? Asked by the plan reaper before it fails a released run.
CREATE OR REPLACE FUNCTION pgfence._plan_served()
RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT pgfence._executor_serving('plan', '*') > 0;
$$;
REVOKE ALL ON FUNCTION pgfence._plan_served() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_served() TO pgfence_client, pgfence_executor, pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence._plan_served() IS
  'Private: true while at least one live executor serves plans.
A released run (owner NULL) whose heartbeat lapsed fails as interrupted only then; otherwise it waits for one. Security definer: plan_run_step and plan_get run as the caller, who may not read pgfence.executor. Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._executor_check_worker(p_worker text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_worker IS NULL THEN
    RAISE EXCEPTION 'executor: worker is required'
      USING ERRCODE = '22004', DETAIL = 'The registry has one row per executor worker name.',
            HINT = 'Pass the name the executor claims under (host:pid:random by default).';
  END IF;
  IF p_worker = '' OR length(p_worker) > 200 THEN
    RAISE EXCEPTION 'executor: worker must be a non-empty name of at most 200 characters'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_worker)),
            HINT = 'Use the name the executor claims under (visible in the lease views).';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._executor_check_worker(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._executor_check_worker(text) IS
  'Private: validates an executor''s worker name.
Raises 22004 (NULL) or 22023 (empty, > 200 characters).';

-- ---------------------------------------------------------------------------------------------
-- Register, heartbeat, deregister
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.executor_register(
  p_worker      text,
  p_host        text,
  p_pid         integer,
  p_version     text,
  p_serves      jsonb,
  p_concurrency integer,
  p_heartbeat   interval
)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_bad     text;
  v_revived integer := 0;
BEGIN
  PERFORM pgfence._executor_check_worker(p_worker);
  IF p_host IS NULL OR p_pid IS NULL OR p_version IS NULL OR p_serves IS NULL
     OR p_concurrency IS NULL OR p_heartbeat IS NULL THEN
    RAISE EXCEPTION 'executor_register: host, pid, version, serves, concurrency and heartbeat are required'
      USING ERRCODE = '22004', DETAIL = 'The registry shows each of them in audit_executors.',
            HINT = 'Pass them all (the glue does: pgfence.executor.Executor).';
  END IF;
  IF jsonb_typeof(p_serves) <> 'object' THEN
    RAISE EXCEPTION 'executor_register: serves must be a JSON object, got %', jsonb_typeof(p_serves)
      USING ERRCODE = '22023', DETAIL = 'serves maps each module to the queues it serves.',
            HINT = 'E.g. {"outbox": ["*"], "plan": ["*"], "operation": ["resize"]}.';
  END IF;
  SELECT string_agg(k, ', ') INTO v_bad
  FROM jsonb_each(p_serves) AS e(k, v)
  WHERE k NOT IN ('outbox', 'plan', 'operation') OR jsonb_typeof(v) <> 'array'
     OR jsonb_array_length(v) = 0
     OR EXISTS (SELECT 1 FROM jsonb_array_elements(v) q WHERE jsonb_typeof(q) <> 'string');
  IF v_bad IS NOT NULL THEN
    RAISE EXCEPTION 'executor_register: serves has a bad entry: %', v_bad
      USING ERRCODE = '22023', DETAIL = 'Keys are modules (outbox, plan, operation); each value is a non-empty array of queue names, "*" for every queue.',
            HINT = 'E.g. {"outbox": ["*"], "plan": ["*"], "operation": ["resize"]}.';
  END IF;
  IF p_concurrency < 1 OR p_heartbeat <= interval '0' OR p_heartbeat > interval '1 hour' THEN
    RAISE EXCEPTION 'executor_register: concurrency must be at least 1 and heartbeat in (0, 1 hour]'
      USING ERRCODE = '22023', DETAIL = format('Got concurrency %s, heartbeat %s.', p_concurrency, p_heartbeat),
            HINT = 'Pass the executor''s slots and the interval of its heartbeats (its reaper timer).';
  END IF;
  -- Rows of executors stopped or silent for a week go: the registry stays small.
  DELETE FROM pgfence.executor x WHERE x.expires_at < now() - interval '7 days';
  INSERT INTO pgfence.executor AS x (worker, host, pid, version, serves, concurrency,
                                     heartbeat_interval, started_at, last_seen_at, expires_at)
  VALUES (p_worker, p_host, p_pid, p_version, p_serves, p_concurrency, p_heartbeat,
          now(), now(), now() + 3 * p_heartbeat)
  ON CONFLICT (worker) DO UPDATE
  SET host = excluded.host, pid = excluded.pid, version = excluded.version,
      serves = excluded.serves, concurrency = excluded.concurrency,
      heartbeat_interval = excluded.heartbeat_interval, started_at = excluded.started_at,
      last_seen_at = excluded.last_seen_at, expires_at = excluded.expires_at, stopped_at = NULL;
  IF p_serves ? 'plan' THEN
    -- Runs released to executors while none served plans waited (their heartbeat lapsed, the
    -- reaper left them): they get a fresh heartbeat, so that this executor's claim takes them.
    PERFORM pgfence._set_actor(p_worker);
    WITH revived AS (
      UPDATE pgfence.plan p
      SET heartbeat_at = now(), heartbeat_expires_at = now() + p.heartbeat_interval
      WHERE p.status = 'executing' AND p.worker IS NULL AND p.heartbeat_expires_at < now()
      RETURNING p.id
    )
    SELECT count(*) INTO v_revived FROM revived;
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_revived;
END
$$;
REVOKE ALL ON FUNCTION pgfence.executor_register(text, text, integer, text, jsonb, integer, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.executor_register(text, text, integer, text, jsonb, integer, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.executor_register(text, text, integer, text, jsonb, integer, interval) IS
  'Executors, at start: register p_worker with what it serves, its slots and heartbeat interval.
It records host, pid and version too.
p_serves maps modules to queues: {"outbox": ["*"] or channels, "plan": ["*"] or ["external"], "operation": kinds}. The executor is alive until now() + 3 * p_heartbeat unless it heartbeats (executor_heartbeat). Registering again under the same name replaces the row (a restart). An executor that serves plans gives plan runs that waited for one (released, heartbeat lapsed while no executor served plans) a fresh heartbeat, so that its claim takes them; returns how many. Deletes rows silent for 7 days.
Errors: 22004 (a NULL argument), 22023 (worker empty or > 200 characters, serves not an object of module -> non-empty array of names, concurrency < 1, heartbeat outside (0, 1 hour]).';

CREATE OR REPLACE FUNCTION pgfence.executor_heartbeat(p_worker text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._executor_check_worker(p_worker);
  UPDATE pgfence.executor x
  SET last_seen_at = now(), expires_at = now() + 3 * x.heartbeat_interval
  WHERE x.worker = p_worker AND x.stopped_at IS NULL;
  RETURN FOUND;
END
$$;
REVOKE ALL ON FUNCTION pgfence.executor_heartbeat(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.executor_heartbeat(text) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.executor_heartbeat(text) IS
  'Executors, on their reaper timer: p_worker is alive; its deadline moves to now() + 3 intervals.
Returns false if p_worker is not registered or was deregistered (then register again). A lapsed executor is revived by its heartbeat: liveness is only what audit_executors shows.
Errors: 22004 (worker NULL), 22023 (worker empty or > 200 characters).';

CREATE OR REPLACE FUNCTION pgfence.executor_deregister(p_worker text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._executor_check_worker(p_worker);
  UPDATE pgfence.executor x
  SET stopped_at = now(), expires_at = now()
  WHERE x.worker = p_worker AND x.stopped_at IS NULL;
  RETURN FOUND;
END
$$;
REVOKE ALL ON FUNCTION pgfence.executor_deregister(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.executor_deregister(text) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.executor_deregister(text) IS
  'Executors, at shutdown: p_worker stopped; it stays listed (status stopped) for 7 days.
Returns false if p_worker was not registered or already stopped.
Errors: 22004 (worker NULL), 22023 (worker empty or > 200 characters).';

CREATE OR REPLACE FUNCTION pgfence.executor_serving(p_module text, p_queue text)
RETURNS integer
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._audit_check_module(p_module);
  IF p_queue IS NULL THEN
    RAISE EXCEPTION 'executor_serving: queue is required'
      USING ERRCODE = '22004', DETAIL = 'A queue is an outbox channel or an operation kind; ''*'' for plans.',
            HINT = 'Pass the channel, the kind, or ''*''.';
  END IF;
  RETURN pgfence._executor_serving(p_module, p_queue);
END
$$;
REVOKE ALL ON FUNCTION pgfence.executor_serving(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.executor_serving(text, text) TO pgfence_client, pgfence_executor, pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence.executor_serving(text, text) IS
  'How many live executors serve an outbox channel, an operation kind, or plans (queue ''*'').
For any role (pgfence plan execute / show say whether an executor will take a released run). Live = registered, not stopped, heartbeat within three intervals.
Errors: 22004 (module or queue NULL), 22023 (unknown module).';
