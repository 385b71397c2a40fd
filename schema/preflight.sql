-- pgfence schema/preflight.sql — the roles pgfence needs, and what the installing login must be
-- allowed to do. Run first by every `pgfence migrate` (before any migration) and at the top of
-- schema/pgfence.sql. Nothing here needs a superuser when the roles exist already.
--
-- Roles (cluster-wide, NOLOGIN): pgfence_client, pgfence_executor, pgfence_admin — the group roles
-- granted to logins — and pgfence_definer, the owner of every pgfence function and view, which
-- holds only the table privileges the SECURITY DEFINER functions need (functions/99_owner.sql).
--
-- The installing login (it owns schema pgfence and its tables) needs, once:
--   * CREATE on the database (its owner has it), to create schema pgfence;
--   * the four roles: created here if it has CREATEROLE, else by a superuser beforehand;
--   * membership in pgfence_definer, to hand it the functions: granted here if it has
--     CREATEROLE (from PostgreSQL 16 also ADMIN on the role, which its creator has), else by a
--     superuser: GRANT pgfence_definer TO <login>.
-- It needs no superuser and no GRANT SET ON PARAMETER (no function sets a custom setting in a
-- SET clause). A missing privilege stops here with 42501 and a message naming the statement to
-- run; nothing is changed then.
DO $preflight$
DECLARE
  v_login   text := current_user::text;
  v_super   boolean;
  v_mkrole  boolean;
  v_owner   text;
  v_missing text[];
  v_role    text;
BEGIN
  SELECT r.rolsuper, r.rolcreaterole INTO v_super, v_mkrole
  FROM pg_catalog.pg_roles r WHERE r.rolname = current_user;

  SELECT pg_catalog.pg_get_userbyid(n.nspowner)::text INTO v_owner
  FROM pg_catalog.pg_namespace n WHERE n.nspname = 'pgfence';
  IF v_owner IS NULL AND NOT pg_catalog.has_database_privilege(current_database(), 'CREATE') THEN
    RAISE EXCEPTION 'login % may not create schema pgfence in database %: a superuser or the database owner runs: GRANT CREATE ON DATABASE % TO %',
      v_login, current_database(), quote_ident(current_database()), quote_ident(v_login)
      USING ERRCODE = '42501',
            DETAIL = 'Installing pgfence creates schema pgfence, owned by the installing login.',
            HINT = format('Or create the schema for it: CREATE SCHEMA pgfence AUTHORIZATION %I', v_login);
  END IF;
  IF v_owner IS NOT NULL AND v_owner <> v_login AND NOT v_super THEN
    RAISE EXCEPTION 'schema pgfence belongs to %, not to login %: run the install as %', v_owner, v_login, v_owner
      USING ERRCODE = '42501',
            DETAIL = 'Migrations change the tables, which only their owner may do; tables created by another login would have two owners.';
  END IF;

  v_missing := ARRAY(
    SELECT r FROM unnest(ARRAY['pgfence_client', 'pgfence_executor', 'pgfence_admin', 'pgfence_definer']) AS r
    WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles x WHERE x.rolname = r));
  IF cardinality(v_missing) > 0 AND NOT (v_super OR v_mkrole) THEN
    RAISE EXCEPTION 'login % may not create roles (no CREATEROLE): a superuser runs once: % GRANT pgfence_definer TO %;',
      v_login, (SELECT string_agg(format('CREATE ROLE %I NOLOGIN;', r), ' ') FROM unnest(v_missing) AS r),
      quote_ident(v_login)
      USING ERRCODE = '42501',
            DETAIL = format('pgfence needs the NOLOGIN roles %s; they are shared by every database of the cluster.',
                            array_to_string(v_missing, ', ')),
            HINT = 'Or give this login CREATEROLE and install again.';
  END IF;
  FOREACH v_role IN ARRAY v_missing LOOP
    BEGIN
      EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
    EXCEPTION WHEN duplicate_object OR unique_violation THEN
      NULL;  -- a concurrent install created it
    END;
  END LOOP;

  IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = 'pgfence_definer'
             AND (r.rolsuper OR r.rolcanlogin OR r.rolbypassrls OR r.rolcreaterole OR r.rolcreatedb OR r.rolreplication)) THEN
    RAISE EXCEPTION 'role pgfence_definer must be a plain NOLOGIN role: a superuser runs: ALTER ROLE pgfence_definer NOSUPERUSER NOLOGIN NOBYPASSRLS NOCREATEROLE NOCREATEDB NOREPLICATION'
      USING ERRCODE = '42501',
            DETAIL = 'It owns the SECURITY DEFINER functions: they run with its privileges, which must be only the table privileges of functions/99_owner.sql.';
  END IF;

  IF NOT v_super AND NOT pg_catalog.pg_has_role(current_user, 'pgfence_definer', 'MEMBER') THEN
    BEGIN
      IF NOT v_mkrole THEN
        RAISE insufficient_privilege;
      END IF;
      EXECUTE format('GRANT pgfence_definer TO %I', v_login);
    EXCEPTION WHEN insufficient_privilege THEN
      RAISE EXCEPTION 'login % is not a member of role pgfence_definer: a superuser runs: GRANT pgfence_definer TO %',
        v_login, quote_ident(v_login)
        USING ERRCODE = '42501',
              DETAIL = 'The installing login hands every pgfence function and view to pgfence_definer (ALTER ... OWNER), and replaces them on upgrades, as a member of that role.';
    END;
  END IF;
END
$preflight$;
